"""Training GPT-2 from converted datasets (the entry point is train/main.py; the loop is trainer.py)."""
