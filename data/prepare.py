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
its own whatever other file has its name) as uint8 token ids ({train,val,test}.bin) and meta.json
(vocabulary as byte values, split sizes and SHA-256s, source, its checksum, and self_sha256, the
digest of all that); preparing one says where it went, on stderr. A folder is no more readable
than its source file (a 0600 file gives a folder only its owner can read). Two preparations of one
folder take turns (an flock on it). Each use checks meta.json against its self_sha256 and the splits
it reads against meta.json (data/dataset.py): a damaged meta.json or split is prepared again from
its source, with a note.
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
from run_folder import atomic_write, remove_partials  # noqa: E402
from shell import die, memory_for, not_a_file  # noqa: E402

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

def meta_digest(meta):
    """meta.json's self_sha256: the SHA-256 of its other fields as canonical JSON (sorted keys, no
    spaces), so that a flipped bit in its vocabulary is found as damage to meta.json itself."""
    fields = {k: v for k, v in meta.items() if k not in ('self_sha256', 'dir')}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(',', ':')).encode()
                          ).hexdigest()


def refuse_no_file(path):
    """A prepared dataset's file (meta.json, a split) that is a directory, a FIFO, a device or
    socket: one line naming it, never read (a FIFO would block) nor replaced."""
    kind = not_a_file(path)
    if kind:
        die(f"{path} is {kind}, not a file of a prepared dataset: remove it")


def read_meta(folder, digest, say=True):
    """meta.json of a dataset folder completely prepared from the source with this digest, else
    None (the folder is then prepared again). A meta.json that does not parse or fails its
    self_sha256 is said (say) to be damaged, never taken for a changed source."""
    path = os.path.join(folder, 'meta.json')
    refuse_no_file(path)
    try:
        with open(path, 'rb') as f:
            meta = json.loads(f.read())
        intact = isinstance(meta, dict) and meta.get('self_sha256') == meta_digest(meta)
    except OSError:   # not prepared yet, or not this user's to read: prepared (again) if it may be
        return None
    except (ValueError, TypeError):   # TypeError: a field that canonical JSON cannot write
        intact = False
    if not intact:
        if say:
            print(f"note: {path} is damaged (it does not match its self_sha256) or was written "
                  "by an older version: not used; the data are prepared again from their source",
                  file=sys.stderr)
        return None
    try:
        if (meta['digest'] == digest and isinstance(meta['vocab'], list)
                and meta['sha256'].keys() == meta['splits'].keys()
                and all(os.path.getsize(os.path.join(folder, f'{s}.bin')) == n
                        for s, n in meta['splits'].items())):
            return meta | {'dir': folder}
    except (OSError, KeyError, TypeError, AttributeError):
        pass
    return None


def write_splits(folder, digest, make, again=False, readers=0o044):
    """The dataset folder prepared from the source with this digest: make() -> (ids, vocab,
    percents, source), cut into consecutive train/val(/test) parts by percentage, meta.json last.
    Under an flock on the folder, so that two preparations take turns rather than mix their files;
    the second finds the first's work done, unless it prepares again a damaged folder. The
    partial files of a preparation whose process is gone (a kill) are removed meanwhile. readers:
    the group and other read bits of the source's mode; the folder and its files get no more."""
    os.makedirs(folder, mode=0o700 | readers | readers >> 2, exist_ok=True)
    narrow(folder, readers)
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
        remove_partials(folder)
        meta = None if again else read_meta(folder, digest, say=False)
        return meta if meta is not None else write_locked(folder, digest, *make(), readers)
    finally:
        os.close(lock)


def narrow(folder, readers):
    """A prepared folder made no more readable than its source (readers: the group and other read
    bits of the source's mode): a source made private since its preparation makes the folder so,
    at its next use. Its files need no change: without search permission on the folder, nobody
    else reaches them."""
    allowed = 0o700 | readers | readers >> 2   # read, and search for a folder, for the same
    mode = stat.S_IMODE(os.stat(folder).st_mode)
    if mode & ~allowed:
        os.chmod(folder, mode & allowed)


def write_locked(folder, digest, ids, vocab, percents, source, readers):
    """write_splits's work, its lock held: each split's SHA-256 goes into meta.json, for
    verified(), and meta.json's own into it; each file readable by no more than `readers`."""
    sizes = [len(ids) * p // 100 for p in percents[:-1]]
    sizes.append(len(ids) - sum(sizes))
    splits, sha256, begin = {}, {}, 0
    for split, size in zip(('train', 'val', 'test'), sizes):
        with atomic_write(os.path.join(folder, f'{split}.bin')) as f:
            only_for(f, readers)
            f.write(ids[begin:begin + size])
        splits[split], sha256[split] = size, hashlib.sha256(ids[begin:begin + size]).hexdigest()
        begin += size
    meta = dict(vocab=[int(b) for b in vocab], splits=splits, sha256=sha256, source=source,
                digest=digest)
    meta['self_sha256'] = meta_digest(meta)
    with atomic_write(os.path.join(folder, 'meta.json')) as f:
        only_for(f, readers)
        f.write(json.dumps(meta).encode())
    print(f"prepared {folder}: " + ', '.join(f'{s} {n:,}' for s, n in splits.items())
          + f" tokens, vocabulary of {len(vocab)}", file=sys.stderr)   # stdout: eval's JSON
    return meta | {'dir': folder}


def only_for(f, readers):
    """The file f, being written, readable by its owner and at most `readers` (group and other read
    bits): the umask's mode, less what the source's readers lack."""
    mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
    if mode & ~(0o600 | readers):
        os.fchmod(f.fileno(), mode & (0o600 | readers))


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
            f.seek(0)
            return unzip_verified(f, name, source)
    except (OSError, http.client.HTTPException) as e:   # urllib's URLError is an OSError
        # writing the archive failed, not the download
        if getattr(e, 'errno', None) == errno.ENOSPC:
            die(f"no space left on the device for {archive} ({e}); free some and run again")
        die(f"could not download {url} ({e}); download it by hand and put it at {archive}")
    except ValueError as e:
        die(f"the download of {url} failed verification: {e}")


def unzip_verified(path, name, source):
    """The archive's member `name` (path: the archive's path or open file), checked against the
    expected size and digest; a ValueError says what is wrong with it."""
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


def prepare_download(name, data_dir, again=False, only_read=False):
    """enwik8 or text8, split 90 / 5 / 5 over the corpus's fixed vocabulary; prepared again if it
    was prepared from an archive with another checksum."""
    source, folder = SOURCES[name], os.path.join(data_dir, name)
    digest = ':'.join(source['digest'])
    meta = None if again else read_meta(folder, digest)
    if meta is not None or only_read:
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


def prepare_text(path, folder, percents, again=False, only_read=False):
    """A local text file, byte-level: its distinct bytes are the vocabulary. Prepared again
    whenever the file's contents change, into a folder no more readable than the file."""
    try:
        with open(path, 'rb') as f:
            raw = f.read()
            readers = os.fstat(f.fileno()).st_mode & 0o044
    except OSError as e:
        die(f"cannot read the dataset {path}: {e.strerror or e}")
    if not raw:
        die(f"{path} is empty")
    digest = 'sha256:' + hashlib.sha256(raw).hexdigest()
    meta = None if again else read_meta(folder, digest)
    if only_read:
        return meta
    if meta is not None:
        narrow(folder, readers)
        return meta
    data = np.frombuffer(raw, dtype=np.uint8)
    vocab = np.unique(data)
    make = lambda: (np.searchsorted(vocab, data).astype(np.uint8), vocab, percents,
                    os.path.abspath(path))
    return write_splits(folder, digest, make, again, readers)


def prepare(name, data_dir='', again=False, only_read=False):
    """meta (with 'dir') of the prepared dataset `name`, preparing it if needed; again: even if it
    looks prepared (a split was found damaged); only_read: None rather than prepare it (a folder
    that a checkpoint names is read from, never written to)."""
    data_dir = data_dir or HERE   # resolved here, so a moved checkout still works
    if name in SOURCES:
        return prepare_download(name, data_dir, again, only_read)
    if name == 'shakespeare':
        return prepare_text(BUNDLED, os.path.join(data_dir, 'shakespeare'), (90, 10), again,
                            only_read)
    return prepare_text(name, text_file_dir(name, data_dir), (90, 5, 5), again, only_read)


def text_file_dir(path, data_dir):
    """data_dir/<the file's stem>-<8 hex digits of the SHA-256 of its full path>/, where a dataset
    given as a text file is prepared: two files of one name never share a folder (nor one named
    like a dataset, enwik8.txt, that dataset's). A path that is not a regular file is refused,
    saying what it is."""
    if not os.path.exists(path):
        die(f"dataset {path!r} is neither shakespeare, enwik8, text8, mix nor an existing file")
    if not_a_file(path):   # a FIFO would hand its data over once, and a directory has none
        die(f"dataset {path!r} is {not_a_file(path)}, not a regular file: a dataset is a file read "
            "whole at each use (to check its prepared data against it)")
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
            with memory_for(f"preparing the dataset {n}", "give a smaller one"):
                meta = prepare(n, options['data_dir'])
            print(f"{n}: {meta['dir']}: "
                  + ', '.join(f'{s} {k:,}' for s, k in meta['splits'].items())
                  + f" tokens, vocabulary of {len(meta['vocab'])}")
    except OSError as e:   # an unwritable data_dir, a full disk: the system's own one-line reason
        die(e)


if __name__ == '__main__':
    main(sys.argv[1:])
