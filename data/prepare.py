"""
data/prepare.py: the character-level datasets downloaded, verified and prepared; data/dataset.py
loads what this writes, for train_char.py and eval_char.py.

    python data/prepare.py enwik8                    # download, check and prepare enwik8
    python data/prepare.py shakespeare text8 mix     # several at once; mix is enwik8 and text8
    python data/prepare.py notes.txt --data_dir=/big/disk/data

train_char.py prepares a dataset on its first use, so running this is optional: it does the
download ahead, on a machine with a network say.

Datasets are prepared once into <data_dir>/<name>/ (data_dir '' is this folder, data/ in the
repository; a text file goes into <data_dir>/<its stem>-<8 hex digits of its full path's SHA-256>/,
its own whatever other file has its name) as uint8 token ids ({train,val,test}.bin, read with
np.memmap) and meta.json (vocabulary as byte values, split sizes and SHA-256s, source, its
checksum); preparing one says where it went, on stderr. Two preparations of one folder take turns
(an flock on it). Each use checks the splits it maps against meta.json (data/dataset.py): a
damaged split is prepared again from its source, with a note.
    shakespeare  the bundled data/shakespeare/input.txt: its distinct bytes, 90% train / 10% val
                 (no test split, so eval reports val only)
    enwik8       the first 10^8 bytes of English Wikipedia XML: 256 bytes, 90M / 5M / 5M
    text8        10^8 characters of a-z and space: 27 symbols, 90M / 5M / 5M
    mix          the paper's 50-50 mixture of enwik8 and text8 over the 256-byte vocabulary:
                 each training row comes from either with probability 1/2 (train_char.get_batch)
    PATH         any text file, read as bytes: its distinct bytes, 90 / 5 / 5, under
                 data/<its stem>-<digest>/
Without a network, put enwik8.zip or text8.zip (from mattmahoney.net/dc/) in data/enwik8/ or
data/text8/.
"""
import contextlib
import errno
import fcntl
import hashlib
import http.client
import json
import os
import stat
import sys
import urllib.request
import zipfile
import zlib

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == '__main__':
    # run as a script: the repository root, which holds configurator.py, is above
    sys.path.insert(0, os.path.dirname(HERE))
from configurator import configure  # noqa: E402
from run_folder import atomic_write  # noqa: E402
from shell import die  # noqa: E402

# The downloadable corpora. The tests point these at small archives of their own.
SOURCES = {
    'enwik8': dict(url='http://mattmahoney.net/dc/enwik8.zip', size=10**8,
                   digest=('md5', 'a1fa5ffddb56f4953e226637dabbb36a'), vocab=list(range(256))),
    # mattmahoney.net publishes no checksum for text8; this SHA-1 is the one that Apache
    # MXNet and GluonNLP check their text8 downloads against
    'text8': dict(url='http://mattmahoney.net/dc/text8.zip', size=10**8,
                  digest=('sha1', '0dc3edebc970dcc96137e7deda4d9995af9d93de'),
                  vocab=list(b' abcdefghijklmnopqrstuvwxyz')),
}
MIX = ('enwik8', 'text8')
BUNDLED = os.path.join(HERE, 'shakespeare', 'input.txt')


# ---------------------------------------------------------------------------------------------
# Preparation

def read_meta(folder, digest):
    """meta.json of a dataset folder completely prepared from the source with this digest, else
    None (the folder is then prepared again)."""
    try:
        with open(os.path.join(folder, 'meta.json')) as f:
            meta = json.load(f)
        if (meta['digest'] == digest and isinstance(meta['vocab'], list)
                and meta['sha256'].keys() == meta['splits'].keys()
                and all(os.path.getsize(os.path.join(folder, f'{s}.bin')) == n
                        for s, n in meta['splits'].items())):
            return meta | {'dir': folder}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def write_splits(folder, digest, make, again=False):
    """The dataset folder prepared from the source with this digest: make() -> (ids, vocab,
    percents, source), cut into consecutive train/val(/test) parts by percentage, meta.json last.
    Under an flock on the folder, so that two preparations take turns rather than mix their files;
    the second finds the first's work done, unless it prepares again a damaged folder."""
    os.makedirs(folder, exist_ok=True)
    lock = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process preparing {folder}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            # a file system without flock (some NFS): each use's check still finds a mix
            pass
        meta = None if again else read_meta(folder, digest)
        return meta if meta is not None else write_locked(folder, digest, *make())
    finally:
        os.close(lock)


def write_locked(folder, digest, ids, vocab, percents, source):
    """write_splits's work, its lock held: each split's SHA-256 goes into meta.json, for
    verified()."""
    sizes = [len(ids) * p // 100 for p in percents[:-1]]
    sizes.append(len(ids) - sum(sizes))
    splits, sha256, begin = {}, {}, 0
    for split, size in zip(('train', 'val', 'test'), sizes):
        with atomic_write(os.path.join(folder, f'{split}.bin')) as f:
            f.write(ids[begin:begin + size])
        splits[split], sha256[split] = size, hashlib.sha256(ids[begin:begin + size]).hexdigest()
        begin += size
    meta = dict(vocab=[int(b) for b in vocab], splits=splits, sha256=sha256, source=source,
                digest=digest)
    with atomic_write(os.path.join(folder, 'meta.json')) as f:
        f.write(json.dumps(meta).encode())
    print(f"prepared {folder}: " + ', '.join(f'{s} {n:,}' for s, n in splits.items())
          + f" tokens, vocabulary of {len(vocab)}", file=sys.stderr)   # stdout: eval's JSON
    return meta | {'dir': folder}


def download(name, archive):
    """The verified contents of enwik8 or text8, downloaded: the archive appears at `archive` only
    once complete and verified. A dropped connection, a Ctrl-C or a failed check leaves nothing
    behind (atomic_write), and the next attempt starts over; two runs downloading at once each
    write their own temporary file."""
    source = SOURCES[name]
    url = source['url']
    print(f"downloading {url} to {archive}", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=60) as response, atomic_write(archive) as f:
            size = int(response.headers.get('Content-Length') or 0) or None
            with tqdm(total=size, unit='B', unit_scale=True, desc=os.path.basename(archive)) as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
            f.flush()
            return unzip_verified(f.name, name, source)
    except (OSError, http.client.HTTPException) as e:   # urllib's URLError is an OSError
        # writing the archive failed, not the download
        if getattr(e, 'errno', None) == errno.ENOSPC:
            die(f"no space left on the device for {archive} ({e}); free some and run again")
        die(f"could not download {url} ({e}); download it by hand and put it at {archive}")
    except ValueError as e:
        die(f"the download of {url} failed verification: {e}")


def unzip_verified(path, name, source):
    """The archive's member `name`, checked against the expected size and digest; a ValueError
    says what is wrong with it."""
    try:
        with zipfile.ZipFile(path) as z:
            data = z.read(name)
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, zlib.error) as e:
        raise ValueError(f"not a zip archive holding {name} ({e})")
    algorithm, expected = source['digest']
    digest = hashlib.new(algorithm, data).hexdigest()
    if len(data) != source['size'] or digest != expected:
        raise ValueError(f"{name} is {len(data):,} bytes with {algorithm} {digest}, "
                         f"expected {source['size']:,} bytes with {algorithm} {expected}")
    return data


def fetch(name, archive):
    """The verified contents of enwik8 or text8: from the archive if it is there (or was put
    there by hand), else downloaded."""
    if not os.path.exists(archive):
        return download(name, archive)
    try:
        return unzip_verified(archive, name, SOURCES[name])
    except ValueError as e:
        die(f"{archive}: {e}; delete it to download it again")


def prepare_download(name, data_dir, again=False):
    """enwik8 or text8, split 90 / 5 / 5 over the corpus's fixed vocabulary; prepared again if it
    was prepared from an archive with another checksum."""
    source, folder = SOURCES[name], os.path.join(data_dir, name)
    digest = ':'.join(source['digest'])
    meta = None if again else read_meta(folder, digest)
    if meta is not None:
        return meta
    archive = os.path.join(folder, name + '.zip')
    with removed_if_left_empty(folder):
        data = fetch(name, archive)
    vocab = source['vocab']
    lookup = np.full(256, 255, dtype=np.uint8)
    lookup[vocab] = np.arange(len(vocab), dtype=np.uint8)
    ids = lookup[np.frombuffer(data, dtype=np.uint8)]
    if len(vocab) < 256 and (ids == 255).any():
        die(f"{archive}: {name} holds bytes outside its {len(vocab)}-symbol vocabulary")
    return write_splits(folder, digest, lambda: (ids, vocab, (90, 5, 5), source['url']), again)


@contextlib.contextmanager
def removed_if_left_empty(folder):
    """folder, made with its missing parents; those this process made are removed again if it
    leaves them empty (a download that failed or was stopped), so that no empty dataset folder
    looks like data that are there."""
    made, path = [], os.path.abspath(folder)
    while not os.path.isdir(path):
        made.append(path)
        path = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    try:
        yield
    finally:
        for path in made:   # deepest first; one that holds anything stays, and its parents
            try:
                os.rmdir(path)
            except OSError:
                break


def prepare_text(path, folder, percents, again=False):
    """A local text file, byte-level: its distinct bytes are the vocabulary. Prepared again
    whenever the file's contents change."""
    try:
        with open(path, 'rb') as f:
            raw = f.read()
    except OSError as e:
        die(f"cannot read the dataset {path}: {e.strerror or e}")
    if not raw:
        die(f"{path} is empty")
    digest = 'sha256:' + hashlib.sha256(raw).hexdigest()
    meta = None if again else read_meta(folder, digest)
    if meta is not None:
        return meta
    data = np.frombuffer(raw, dtype=np.uint8)
    vocab = np.unique(data)
    make = lambda: (np.searchsorted(vocab, data).astype(np.uint8), vocab, percents,
                    os.path.abspath(path))
    return write_splits(folder, digest, make, again)


def prepare(name, data_dir='', again=False):
    """meta (with 'dir') of the prepared dataset `name`, preparing it if needed; again: even if it
    looks prepared (a split was found damaged)."""
    data_dir = data_dir or HERE   # resolved here, so a moved checkout still works
    if name in SOURCES:
        return prepare_download(name, data_dir, again)
    if name == 'shakespeare':
        return prepare_text(BUNDLED, os.path.join(data_dir, 'shakespeare'), (90, 10), again)
    return prepare_text(name, text_file_dir(name, data_dir), (90, 5, 5), again)


def text_file_dir(path, data_dir):
    """data_dir/<the file's stem>-<8 hex digits of the SHA-256 of its full path>/, where a dataset
    given as a text file is prepared: two files of one name never share a folder (nor one named
    like a dataset, enwik8.txt, that dataset's). A path that is not a regular file is refused,
    saying what it is."""
    if not os.path.exists(path):
        die(f"dataset {path!r} is neither shakespeare, enwik8, text8, mix nor an existing file")
    if not os.path.isfile(path):   # a FIFO would hand its data over once, and a directory has none
        kind = ('a directory' if os.path.isdir(path) else 'a FIFO (named pipe)'
                if stat.S_ISFIFO(os.stat(path).st_mode) else 'a device or socket')
        die(f"dataset {path!r} is {kind}, not a regular file: a dataset is a file read whole at "
            "each use (to check its prepared data against it)")
    full = os.path.realpath(path).encode(errors='surrogateescape')
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(data_dir, f'{stem}-{hashlib.sha256(full).hexdigest()[:8]}')


def corpus_names(name, data_dir=''):
    """The corpora a dataset stands for (mix: enwik8 and text8), each checked to be a named
    dataset or a usable text file before anything is downloaded or prepared."""
    names = MIX if name == 'mix' else (name,)
    for n in names:
        if n not in SOURCES and n != 'shakespeare':
            text_file_dir(n, data_dir or HERE)
    return names


def main(argv):
    options, _ = configure(dict(data_dir=''), [a for a in argv if a.startswith('-')], doc=__doc__)
    names = [a for a in argv if not a.startswith('-')]
    if not names:
        die("name the datasets to prepare: shakespeare, enwik8, text8, mix or a text file")
    try:
        # all checked first
        expanded = [n for name in names for n in corpus_names(name, options['data_dir'])]
        for n in dict.fromkeys(expanded):   # each once: `enwik8 mix` prepares enwik8 once
            meta = prepare(n, options['data_dir'])
            print(f"{n}: {meta['dir']}: "
                  + ', '.join(f'{s} {k:,}' for s, k in meta['splits'].items())
                  + f" tokens, vocabulary of {len(meta['vocab'])}")
    except OSError as e:   # an unwritable data_dir, a full disk: the system's own one-line reason
        die(e)


if __name__ == '__main__':
    main(sys.argv[1:])
