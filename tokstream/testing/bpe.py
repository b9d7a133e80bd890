"""A real Hugging Face tokenizer without a network: a byte-level BPE trained on the given texts."""

from pathlib import Path


def train_bpe(path: Path, texts: list[str], specials: list[str], vocab_size: int = 2000) -> Path:
    """Train it (the specials take ids 0, 1, ...) and save it as a tokenizer.json at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path
