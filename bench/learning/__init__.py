"""The learning experiment's harness (run by bench/learning.py, bench/learning_eval.py
and bench/learning_warm_pilot.py): the naive "full" arm and the hybrid model preset
(`arms.py`); the JSON files here are the runs' configs."""
