"""The benchmarks: scripts run from the repository root as
`python -m benchmarks.<name>` (see README.md), their models in `zoo`, their
timing in `timing`, kernel counting in `hlo`."""
