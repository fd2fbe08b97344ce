"""What capture keeps and replay reads: one small class per prompt state kind
(`prompt.py`), the branches' own state during decoding (`branch.py`), and state offload to
host memory (`offload.py`, over the arenas of `host_arena.py`)."""
