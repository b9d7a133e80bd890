"""Training GPT-2 from converted datasets (the entry point is train/main.py; the loop is trainer.py).
Its data comes through the public reader API, tokstream.reader, alone."""
