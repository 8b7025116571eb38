"""The recipe matrix's cases (support/recipe_matrix.RecipeCase), one module a family of recipes,
in the order of docs/tinker.md's recipe table."""

from __future__ import annotations

from support.recipe_cases import preference, reinforcement, supervised
from support.recipe_matrix import RecipeCase

CASES: tuple[RecipeCase, ...] = (*supervised.CASES, *reinforcement.CASES, *preference.CASES)
