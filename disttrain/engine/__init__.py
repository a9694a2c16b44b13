"""The training engine shared by every strategy: loop, optimizer and schedule, task losses."""
