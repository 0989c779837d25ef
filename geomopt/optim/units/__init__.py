"""The update units: directions, post-stages and schedules, each declared once, and the tables
derived from the declarations."""
