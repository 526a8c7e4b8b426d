"""Parallelism beyond the mesh: pipeline schedules (`schedules`, `schedule_check`)."""
