"""Recipe matrix cases: PLACEHOLDER."""

from __future__ import annotations

from support.recipe_matrix import RecipeCase

CASES: tuple[RecipeCase, ...] = ()
