"""The platform on one machine: starting and stopping its processes (launcher), the whole stack
(stack), and ``make up`` (up)."""
