"""One typed settings object per service (``LOOPLINE_*``), and the README's table made from them."""
