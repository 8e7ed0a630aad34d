"""
data/dataset.py: a prepared dataset loaded for training and evaluation: each corpus's splits read
into memory (checked against meta.json), the vocabulary, and text <-> token ids. data/prepare.py
downloads and prepares the datasets on first use.

The splits are read whole into this process's memory, not mapped (np.memmap): a mapped file is the
file on disk, so one truncated under a running run ends it with SIGBUS, and one rewritten with ids
past the vocabulary in an IndexError, neither of which a lock prevents (flock is advisory). The
check against meta.json reads every byte anyway; the bytes read are the bytes checked and kept.
The cost is memory: a split's size (enwik8's train split, 90 MB).

    from data.dataset import load_dataset, encode, decode
    corpora, vocab = load_dataset('shakespeare')     # corpora[0].splits['train']: uint8 token ids
"""
import dataclasses
import hashlib
import os
import sys

import numpy as np

from data.prepare import HERE, SOURCES, corpus_names, prepare, refuse_no_file
from shell import die, memory_for


@dataclasses.dataclass
class Corpus:
    """One corpus of a dataset, as train_char.get_batch and eval_char read it (mix has two)."""
    name: str                 # enwik8, text8, shakespeare or a text file's path
    dir: str                  # the folder it was prepared in
    splits: dict              # {'train', 'val'(, 'test'): uint8 token ids, in memory}
    lut: np.ndarray | None    # its token ids -> the model's (mix: text8's 27 into 256);
                              # None: the same
    meta: dict = None         # its meta.json: vocab, the splits' sha256, self_sha256


def load_dataset(name, data_dir='', vocab=None, also_in=None, expected=None):
    """(corpora, vocabulary): a Corpus per corpus of the dataset (mix has two), prepared on first
    use. The vocabulary, a list of byte values, is the union of the corpora's unless a checkpoint
    fixes it. also_in: a folder that may already hold them (a checkpoint's data_dir), read from,
    never prepared into; expected: per corpus, the data a checkpoint recorded (or None), which
    what also_in holds must be."""
    names = corpus_names(name, data_dir)
    expected = expected if expected and len(expected) == len(names) else [None] * len(names)
    # memory that runs out here is the data's, whatever the model's settings
    with memory_for(f"preparing or loading the dataset {name}", "give a smaller one"):
        metas, mapped = zip(*(found(n, also_in, e, data_dir) or verified(n, data_dir)
                              for n, e in zip(names, expected)))
    if vocab is None:
        vocab = sorted(set().union(*(m['vocab'] for m in metas)))
    components = []
    for n, meta, splits, e in zip(names, metas, mapped, expected):
        outside = sorted(set(meta['vocab']) - set(vocab))
        if outside:
            die(f"dataset {n} has {len(outside)} characters outside the model's vocabulary, "
                f"e.g. {bytes(outside[:10])!r}"
                + (": not the data the checkpoint was trained on (another file of that name, or "
                   "one changed since)" if e is not None and not same_data(meta, e) else ''))
        lut = None if meta['vocab'] == vocab else np.array([vocab.index(b) for b in meta['vocab']])
        components.append(Corpus(n, meta['dir'], splits, lut, meta))
    return components, vocab


def record(name, corpora):
    """What a checkpoint records of its data, to which checkpoint.load_data holds a resume or an
    evaluation: the dataset as given, a text file's absolute path (where to find it from another
    folder), and per corpus its vocabulary, its splits' SHA-256s and meta.json's self_sha256."""
    text_file = name not in ('shakespeare', 'mix', *SOURCES)
    return dict(dataset=name, path=os.path.abspath(name) if text_file else None,
                corpora=[dict(name=c.name, vocab=c.meta['vocab'], sha256=c.meta['sha256'],
                              meta_sha256=c.meta['self_sha256']) for c in corpora])


def same_data(meta, record):
    """Whether a prepared corpus (its meta.json) holds the data a checkpoint recorded: the same
    vocabulary and splits. Not meta.json's own digest, which also covers the source's path: a
    moved file of the same content holds the same data."""
    return meta['vocab'] == record['vocab'] and meta['sha256'] == record['sha256']


def found(name, folder, record, data_dir):
    """(meta, splits) of `name` prepared in folder (a checkpoint's data_dir) if it is there,
    intact and (record) the data the checkpoint recorded; else None, with a note if it holds
    something else, and the caller prepares them in data_dir. Nothing is written to folder."""
    if folder is None:
        return None
    meta = prepare(name, folder, only_read=True)
    if meta is None:
        return None
    splits, damage = read_splits(meta)
    if record is not None and not same_data(meta, record):
        damage = 'other data than the checkpoint records'
    if not damage:
        return meta, splits
    print(f"note: {meta['dir']}, in the checkpoint's data_dir: {damage}; not used, nor prepared "
          f"again there: the data are read, or prepared, in {data_dir or HERE}", file=sys.stderr)
    return None


def read_splits(meta):
    """(splits, damage): a prepared folder's splits read into memory, and what is wrong with them
    against meta.json ('' if nothing)."""
    paths = {s: os.path.join(meta['dir'], f'{s}.bin') for s in meta['splits']}
    for path in paths.values():
        refuse_no_file(path)
    splits = {s: np.fromfile(path, dtype=np.uint8) for s, path in paths.items()}
    damage = '; '.join(f'{s}.bin {why}' for s, ids in splits.items()
                       if (why := split_damage(ids, meta['sha256'][s], len(meta['vocab']))))
    return splits, damage


def verified(name, data_dir):
    """(meta, splits in memory) of a prepared dataset, the very bytes that a run reads checked
    against meta.json: a damaged split (or the splits of two preparations mixed) is prepared again
    from its source, with a note; where the source is gone, preparing says so in one line."""
    meta = prepare(name, data_dir)
    for again in (False, True):
        splits, damage = read_splits(meta)
        if not damage:
            return meta, splits
        if again:
            die(f"{meta['dir']}: {damage}, though just prepared again from its source: "
                "is the disk failing?")
        print(f"note: {meta['dir']}: {damage}; preparing it again from its source "
              f"({meta['source']})", file=sys.stderr)
        meta = prepare(name, data_dir, again=True)


def split_damage(ids, sha256, vocab_size):
    """What is wrong with a split's token ids, or None: the SHA-256 that meta.json gives them (one
    read of the data, a small part of a run's start-up), and their largest against the
    vocabulary."""
    if hashlib.sha256(ids).hexdigest() != sha256:
        return "does not match its SHA-256 in meta.json (damaged, or overwritten)"
    if len(ids) and ids.max() >= vocab_size:
        return f"holds token id {ids.max()}, past its {vocab_size}-symbol vocabulary"
    return None


def check_lengths(components, splits, block_size):
    """Refuse a split too short for one row of block_size + 1 tokens."""
    for c in components:
        for s in splits:
            if s in c.splits and len(c.splits[s]) <= block_size:
                die(f"the {s} split of {c.name} has {len(c.splits[s])} tokens, "
                    f"too few for block_size={block_size}")


def encode(start, vocab, block_size):
    """The prompt's token ids. The model reads bytes, so a prompt is bytes: FILE:path is read as
    bytes (any, UTF-8 or not), and a command-line prompt is the bytes it was typed as (Python
    hands on bytes that are not UTF-8 as surrogate escapes, which turn back into them here)."""
    if start.startswith('FILE:'):
        try:
            with open(start[5:], 'rb') as f:
                # a token past the context tells one too long; /dev/zero ends
                data = f.read(block_size + 1)
        except OSError as e:
            die(f"cannot read the prompt from {start[5:]}: {e}")
    elif start == '':
        default = [b for b in b'\n ' if b in vocab]
        if not default:
            die("the dataset has neither a newline nor a space, one of which an empty --start "
                "stands for: give a prompt with --start")
        data = bytes(default[:1])
    else:
        try:
            data = start.encode('utf-8', errors='surrogateescape')
        except UnicodeEncodeError as e:
            die(f"the prompt cannot be written as bytes: {e.reason} at character {e.start} "
                f"({start[e.start]!r})")
    index = {b: i for i, b in enumerate(vocab)}
    if set(data) - set(index):
        text = data.decode('utf-8', errors='surrogateescape')   # whole characters, for the message
        outside = sorted({ch for ch in text
                          if set(ch.encode('utf-8', errors='surrogateescape')) - set(index)})
        die(f"the prompt has characters outside the model's {len(vocab)}-symbol vocabulary: "
            + ' '.join(repr(ch.encode('utf-8', errors='surrogateescape')
                            if '\udc80' <= ch <= '\udcff' else ch)
                       for ch in outside))
    ids = [index[b] for b in data]
    if not ids:
        die("the prompt is empty")
    if len(ids) > block_size:
        die(f"the prompt is {f'over {block_size}' if start.startswith('FILE:') else len(ids)} "
            f"tokens, longer than the model's context (block_size={block_size})")
    return ids


def decode(ids, vocab):
    # ids past the vocabulary (a vocab_size set larger than it) become 0xFF, which shows as U+FFFD
    return (bytes(vocab[i] if i < len(vocab) else 0xFF for i in ids)
            .decode('utf-8', errors='replace'))
