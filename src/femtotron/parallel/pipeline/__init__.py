"""Pipeline parallelism: stage partition, point-to-point transfers, schedules."""
