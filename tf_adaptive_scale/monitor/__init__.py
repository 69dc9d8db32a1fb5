"""Floor 7, monitor: what a user sees of the scaling.

The `ScaleMonitor` callback (`callback`), its typed log record (`monitor_log`),
the diagnoses of a report (`diagnoses`, `float16_analysis`), TensorBoard
events and the search for the first non-finite layer (`forward_check`).
"""
