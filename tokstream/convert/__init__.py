"""The converters' core: a corpus or token files into a block-aligned MDS dataset (the commands in convert/ are
thin layers over it). Its modules, in the order a document travels:

    where documents come from     sources.py (text files, hub datasets), token_files.py and remote_token_files.py
                                  (token files on disk or behind a URL)
    how they are cleaned          cleaning.py (normalisation, exact dedup)
    how they are tokenized        tokenize_docs.py (in parallel, in input order; tokenizers: tokstream/tokenizer.py)
    how samples are written       dataset_writer.py (token stream -> samples -> shards -> metadata, through format.py)
    how a conversion is staged,   staging.py (an output appears only when complete), resume.py (what a killed
    resumed and guarded           conversion leaves to resume from), output_guard.py (what it may replace, the lock)
    how it runs                   text_one_pass.py (text in one pass), text_parts.py (text in parts, then merged),
                                  text_conversion.py (which of the two), token_conversion.py (token files)
    how it is checked             verify.py
    the commands' shared options  options.py (a conversion's settings), cli.py (arguments to settings)

What every wing shares stays in tokstream/: format.py (the on-disk format), errors.py, object_store.py (S3),
split_check.py, tokenizer.py.
"""
