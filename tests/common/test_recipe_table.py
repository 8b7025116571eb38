"""docs/tinker.md's recipe table is the recipe matrix's cases (support/recipe_cases), row for row:
a recipe is listed as running here only if the matrix runs it (tests/e2e/test_tinker_recipe_matrix.py)."""

from __future__ import annotations

from pathlib import Path

from support.recipe_matrix import TABLE_END, TABLE_START, all_cases, table

DOC = Path(__file__).resolve().parents[2] / "docs" / "tinker.md"


def test_docs_recipe_table_lists_exactly_the_matrix_cases():
    text = DOC.read_text()
    assert TABLE_START in text and TABLE_END in text, "docs/tinker.md has no recipe table"
    written = text[text.index(TABLE_START):text.index(TABLE_END) + len(TABLE_END)]
    assert written == table(all_cases()), (
        "docs/tinker.md's recipe table differs from the matrix: run "
        "`cd tests && ../.venv/bin/python -m support.recipe_matrix table` and paste its output")


def test_every_case_has_a_unique_name_a_default_loss_and_features():
    cases = all_cases()
    assert len({case.name for case in cases}) == len(cases)
    for case in cases:
        assert case.module.startswith("tinker_cookbook.recipes."), case.name
        assert case.default_loss and case.features, case.name
