"""Context parallelism: the round-robin deal of prompt positions (`deal`, torch-free),
collectives, the divided capture and reverse walk, gradient sums, the FSDP2 shim."""
