"""Figures and reports. Modules here import matplotlib at module level: import them lazily."""
