"""curvax (public API assembled once all modules land)."""
