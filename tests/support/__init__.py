"""Helpers shared by the tests: real servers started for the test run."""
