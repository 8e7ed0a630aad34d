"""
The datasets, data/prepare.py and data/dataset.py: splits and vocabularies, a text file's own
folder, preparation again when a source changes or a split is damaged, two preparations at once,
enwik8 / text8 / mix from small archives made here (their size and checksum set for the test),
downloads from a local server: verified, atomic, never repeated, and each failure one line; a
link as a split refused, and a dead preparation's partial files removed.

    python -m pytest -q tests/test_data.py
"""
import contextlib
import errno
import hashlib
import io
import json
import os
import pathlib
import stat
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

import data.prepare as prep
import eval_char as ec
import train_char as tc
from data import dataset
from common import ENV, ROOT, cli, copy_of, fails, limit_memory, make_corpora, one_line_error, run, text_file


def test_shakespeare_is_split_90_10_over_its_distinct_bytes(data_dir):
    meta = prep.prepare('shakespeare', str(data_dir))
    with open(prep.BUNDLED, 'rb') as f:
        raw = np.frombuffer(f.read(), dtype=np.uint8)
    assert meta['vocab'] == sorted(set(raw.tolist())) and len(meta['vocab']) == 80
    n_train = len(raw) * 90 // 100
    assert meta['splits'] == {'train': n_train, 'val': len(raw) - n_train}
    vocab = np.array(meta['vocab'], dtype=np.uint8)
    train = np.fromfile(os.path.join(meta['dir'], 'train.bin'), dtype=np.uint8)
    val = np.fromfile(os.path.join(meta['dir'], 'val.bin'), dtype=np.uint8)
    assert (vocab[train] == raw[:n_train]).all() and (vocab[val] == raw[n_train:]).all()


def test_text_file_is_split_90_5_5_and_prepared_again_when_it_changes(tmp_path):
    text = tmp_path / 'notes.txt'
    text.write_bytes(b'hello world, ' * 100)
    meta = prep.prepare(str(text), str(tmp_path / 'data'))
    assert meta['dir'] == prep.text_file_dir(str(text), str(tmp_path / 'data'))
    assert meta['splits'] == {'train': 1170, 'val': 65, 'test': 65}
    assert bytes(meta['vocab']) == b' ,dehlorw'
    text.write_bytes(b'abc' * 100)
    assert bytes(prep.prepare(str(text), str(tmp_path / 'data'))['vocab']) == b'abc'
    meta = pathlib.Path(meta['dir']) / 'meta.json'   # damaged (no checksum): prepared again, not a traceback
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != 'digest'}))
    assert bytes(prep.prepare(str(text), str(tmp_path / 'data'))['vocab']) == b'abc' and 'digest' in meta.read_text()


def test_a_split_needs_more_tokens_than_the_context_and_a_file_its_own_folder(tmp_path):
    """A window is block_size + 1 tokens: a split of exactly block_size is refused in one line,
    and a prompt of block_size bytes is taken. A text file named like a dataset is prepared into
    a folder of its own, never over that dataset's prepared folder."""
    split = dataset.Corpus('notes', '', dict(val=np.zeros(16, dtype=np.uint8)), None)
    with pytest.raises(SystemExit, match='the val split of notes has 16 tokens, too few for block_size=16'):
        dataset.check_lengths([split], ('val',), 16)
    dataset.check_lengths([split], ('val',), 15)
    assert dataset.encode('a' * 16, [97], 16) == [0] * 16
    (tmp_path / 'enwik8.txt').write_text('abc' * 100)
    meta = prep.prepare(str(tmp_path / 'enwik8.txt'), str(tmp_path / 'data'))
    assert os.path.basename(meta['dir']).startswith('enwik8-') and not (tmp_path / 'data' / 'enwik8').exists()


def test_prepare_runs_as_a_script_from_anywhere(tmp_path):
    script = os.path.join(ROOT, 'data', 'prepare.py')
    result = subprocess.run([sys.executable, script, 'shakespeare', f'--data_dir={tmp_path}'], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and 'train 1,429,444, val 158,828 tokens' in result.stdout, result.stderr
    assert (tmp_path / 'shakespeare' / 'meta.json').exists()
    result = subprocess.run([sys.executable, script, 'shakespeare', 'no/such.txt', f'--data_dir={tmp_path / "new"}'],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.startswith('error: dataset') and result.stderr.count('\n') == 1
    assert not (tmp_path / 'new').exists()   # every name is checked before the first is prepared


def test_a_split_file_of_the_wrong_size_is_prepared_again(tmp_path):
    """A .bin file whose size is not the one meta.json gives (cut short, say) leaves the folder
    unprepared: the next use writes it again in full rather than reading the short one."""
    text = tmp_path / 'notes.txt'
    text.write_bytes(b'hello world, ' * 100)
    val = pathlib.Path(prep.prepare(str(text), str(tmp_path / 'data'))['dir']) / 'val.bin'
    whole = val.read_bytes()
    val.write_bytes(whole[:10])
    assert prep.prepare(str(text), str(tmp_path / 'data'))['splits']['val'] == 65
    assert val.read_bytes() == whole


def test_an_interrupted_preparation_is_done_again(tmp_path, monkeypatch):
    """meta.json, which marks a folder prepared, is written after every .bin file: a text file
    that changed (same length, so each old .bin keeps the size meta.json gives), whose preparation
    is interrupted at its last .bin, is prepared in full at the next use, not left part old."""
    text = tmp_path / 'notes.txt'
    text.write_bytes(b'ab' * 500)
    data = str(tmp_path / 'data')
    prep.prepare(str(text), data)
    text.write_bytes(b'ba' * 500)
    write = prep.atomic_write

    def interrupted(path):
        if path.endswith('test.bin'):
            raise KeyboardInterrupt
        return write(path)
    monkeypatch.setattr(prep, 'atomic_write', interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(str(text), data)
    monkeypatch.undo()
    meta = prep.prepare(str(text), data)
    ids = np.concatenate([np.fromfile(os.path.join(meta['dir'], f'{s}.bin'), dtype=np.uint8)
                          for s in ('train', 'val', 'test')])
    assert bytes(np.array(meta['vocab'], dtype=np.uint8)[ids]) == b'ba' * 500


def test_prepare_script_says_why_a_data_dir_cannot_be_made_in_one_line(tmp_path):
    """data/prepare.py with a data_dir below a file (a folder that cannot be made): the system's
    reason, naming the path, in one line rather than a traceback."""
    text = tmp_path / 'notes.txt'
    text.write_bytes(b'hello world, ' * 100)
    blocker = tmp_path / 'afile'
    blocker.write_text('')
    message = fails(text, f'--data_dir={blocker / "data"}', main=prep.main)
    assert 'Not a directory' in message and str(blocker) in message


def test_prepare_script_calls_a_single_dash_a_mistyped_option(tmp_path):
    """data/prepare.py -x: an option mistyped (options are --key=value), not a missing config file;
    a file named -notes.txt is never run as a config file, and the line says how to name it."""
    one_line_error(cli('-x', 'shakespeare', f'--data_dir={tmp_path}', script='data/prepare.py'),
                   '-x: no such option (options are written --key=value')
    (tmp_path / '-notes.txt').write_text("open('EXECUTED', 'w')\n")
    result = subprocess.run([sys.executable, os.path.join(ROOT, 'data', 'prepare.py'), '-notes.txt'], cwd=tmp_path,
                            env=ENV, capture_output=True, text=True, timeout=120)
    one_line_error(result, '-notes.txt: no such option (options are written --key=value; --help lists them); '
                           'a file of that name is written ./-notes.txt')
    assert not (tmp_path / 'EXECUTED').exists()


def test_prepare_script_names_a_file_too_big_for_memory(tmp_path):
    """data/prepare.py on a text file that cannot be prepared under ulimit -v: one line naming the
    file and the limit."""
    big = tmp_path / 'big.txt'
    with open(big, 'wb') as f:   # 400 MB of zero bytes, sparse: its token ids need 3.2 GB as int64
        f.truncate(400 * 10**6)
    result = cli(str(big), f'--data_dir={tmp_path / "data"}', script='data/prepare.py',
                 preexec_fn=limit_memory(3 * 10**9))
    one_line_error(result, f'out of memory preparing the dataset {big} (')
    assert 'the memory limit (ulimit -v) of 2,861 MiB: raise the limit, or give a smaller one' in result.stderr


def test_enwik8_text8_and_mix_from_archives(corpora, monkeypatch, capsys):
    data, contents = corpora
    for name in ('enwik8', 'text8'):
        meta = prep.prepare(name, str(data))
        assert meta['splits'] == {'train': 3600, 'val': 200, 'test': 200}   # 90 / 5 / 5 of 4000
        assert meta['vocab'] == prep.SOURCES[name]['vocab']
        vocab = np.array(meta['vocab'], dtype=np.uint8)
        raw = np.frombuffer(contents[name], dtype=np.uint8)
        for split, (a, b) in dict(train=(0, 3600), val=(3600, 3800), test=(3800, 4000)).items():
            ids = np.fromfile(data / name / f'{split}.bin', dtype=np.uint8)
            assert (vocab[ids] == raw[a:b]).all(), (name, split)
        os.remove(data / name / f'{name}.zip')   # prepared once: the archive is not needed again
        assert prep.prepare(name, str(data))['splits'] == meta['splits']
    assert len(prep.SOURCES['text8']['vocab']) == 27 and bytes(prep.SOURCES['text8']['vocab'][:2]) == b' a'

    components, vocab = dataset.load_dataset('mix', str(data))
    assert vocab == list(range(256)) and [c.name for c in components] == ['enwik8', 'text8']
    assert [c.dir for c in components] == [str(data / 'enwik8'), str(data / 'text8')]
    x, y = tc.get_batch(components, 'train', 4000, 16, torch.Generator().manual_seed(0), 'cpu')
    # the rows as get_batch draws them: a corpus each, then a start in its train split (3600 tokens)
    generator = torch.Generator().manual_seed(0)
    which = torch.randint(2, (4000,), generator=generator)
    offsets = (torch.rand(4000, generator=generator, dtype=torch.float64) * (3600 - 16)).long()
    assert abs(which.float().mean().item() - 0.5) < 0.03   # each row from either with probability 1/2
    raw = {n: np.frombuffer(contents[n], dtype=np.uint8) for n in contents}
    for row, (c, o) in enumerate(zip(which.tolist(), offsets.tolist())):
        expected = raw[components[c].name][o:o + 17]   # text8 rows come as bytes, like enwik8's
        assert x[row].tolist() == expected[:-1].tolist() and y[row].tolist() == expected[1:].tolist()
    assert x.is_contiguous() and y.is_contiguous() and x.dtype == y.dtype == torch.int64

    prep.main(['enwik8', 'mix', f'--data_dir={data}'])   # each dataset once
    assert [line.split(':')[0] for line in capsys.readouterr().out.splitlines()] == ['enwik8', 'text8']
    # data prepared from an archive with another checksum are not used: text8 is fetched again,
    # and its archive is gone (removed above)
    monkeypatch.setitem(prep.SOURCES, 'text8', dict(prep.SOURCES['text8'], digest=('sha1', '0' * 40)))
    with pytest.raises(SystemExit, match='could not download'):
        prep.prepare('text8', str(data))


def test_download_is_verified_renamed_and_not_repeated(tmp_path, monkeypatch, server, capsys):
    folder, url = server
    make_corpora(str(folder), monkeypatch, serve_url=url)
    meta = prep.prepare('enwik8', str(tmp_path / 'data'))
    assert meta['splits']['train'] == 3600 and meta['source'] == f'{url}/enwik8.zip'
    assert sorted(os.listdir(tmp_path / 'data' / 'enwik8')) == ['enwik8.zip', 'meta.json', 'test.bin',
                                                                'train.bin', 'val.bin']
    assert 'enwik8.zip: 100%' in capsys.readouterr().err   # the progress bar
    os.remove(folder / 'enwik8.zip')            # no second download: it would now fail
    assert prep.prepare('enwik8', str(tmp_path / 'data'))['splits']['train'] == 3600

    monkeypatch.setitem(prep.SOURCES, 'text8', dict(prep.SOURCES['text8'], digest=('sha1', '0' * 40)))
    # --max_iters=1: a check that let the archive through would fail fast, not train a whole run
    message = fails('--dataset=text8', f'--data_dir={tmp_path / "data"}', f'--out_dir={tmp_path / "out"}', '--max_iters=1')
    assert 'failed verification' in message and 'sha1' in message
    assert not (tmp_path / 'data' / 'text8').exists()   # no archive, partial one or empty folder


def test_two_runs_downloading_at_once_both_prepare_the_data(tmp_path, monkeypatch, server):
    """Two runs started together on a fresh machine both download enwik8. The other one (another
    process id) downloads, checks and prepares it all while this one is checking its own copy:
    both must end with the data prepared and nothing else left in the folder."""
    folder, url = server
    contents = make_corpora(str(folder), monkeypatch, serve_url=url)
    data = str(tmp_path / 'data')
    check = prep.unzip_verified

    def the_other_run_finishes_meanwhile(*args):
        monkeypatch.setattr(prep, 'unzip_verified', check)
        with monkeypatch.context() as m:
            m.setattr(prep.os, 'getpid', lambda: 1)
            assert prep.prepare('enwik8', data)['splits']['train'] == 3600
        return check(*args)

    monkeypatch.setattr(prep, 'unzip_verified', the_other_run_finishes_meanwhile)
    meta = prep.prepare('enwik8', data)
    assert meta['splits']['train'] == 3600 and prep.unzip_verified is check   # the other run did run
    assert sorted(os.listdir(tmp_path / 'data' / 'enwik8')) == ['enwik8.zip', 'meta.json', 'test.bin',
                                                                'train.bin', 'val.bin']
    with zipfile.ZipFile(tmp_path / 'data' / 'enwik8' / 'enwik8.zip') as z:
        assert z.read('enwik8') == contents['enwik8']


def test_offline_download_says_where_the_archive_goes_and_leaves_no_folder(tmp_path, monkeypatch):
    """Without a network: one line naming where the archive goes, and no empty data_dir/enwik8/
    (nor the data_dir the run made for it) left to look like data that are there; a folder that
    was there before stays."""
    make_corpora(str(tmp_path / 'zips'), monkeypatch)   # URLs point at a closed port
    message = fails('--dataset=mix', f'--data_dir={tmp_path / "data"}', f'--out_dir={tmp_path / "out"}')
    assert 'could not download http://127.0.0.1:9/' in message
    assert f"put it at {tmp_path / 'data' / 'enwik8' / 'enwik8.zip'}" in message
    assert not (tmp_path / 'data').exists()
    (tmp_path / 'data' / 'enwik8').mkdir(parents=True)
    assert 'could not download' in fails('--dataset=enwik8', f'--data_dir={tmp_path / "data"}',
                                         f'--out_dir={tmp_path / "out"}')
    assert os.listdir(tmp_path / 'data') == ['enwik8']
    assert os.listdir(tmp_path / 'data' / 'enwik8') == []


@pytest.mark.parametrize('cut', [ConnectionResetError('connection reset by peer'), KeyboardInterrupt()])
def test_a_dropped_download_leaves_nothing_behind(tmp_path, monkeypatch, cut):
    """The connection drops, or Ctrl-C comes, after the first chunk: one line, and no partial file
    is left in the dataset's folder."""
    make_corpora(str(tmp_path / 'zips'), monkeypatch)

    class Dropped(io.BytesIO):
        headers = {'Content-Length': str(3 << 20)}
        def read(self, n=-1):
            if self.tell():
                raise cut
            return super().read(n)
    monkeypatch.setattr(prep.urllib.request, 'urlopen', lambda url, timeout: Dropped(b'x' * (2 << 20)))
    argv = '--dataset=enwik8', f'--data_dir={tmp_path / "data"}', f'--out_dir={tmp_path / "out"}'
    if isinstance(cut, KeyboardInterrupt):
        with pytest.raises(SystemExit) as e:
            run(*argv)
        assert e.value.code == 130
    else:
        message = fails(*argv)
        assert 'could not download' in message and 'connection reset by peer' in message
    assert not (tmp_path / 'data').exists()


def test_a_full_disk_during_a_download_says_so(tmp_path, monkeypatch):
    """The disk fills while the archive is written: one line that says so (not advice to download
    the archive by hand), and no partial file left behind."""
    make_corpora(str(tmp_path / 'zips'), monkeypatch)
    class Response(io.BytesIO):
        headers = {'Content-Length': str(2 << 20)}
    monkeypatch.setattr(prep.urllib.request, 'urlopen', lambda url, timeout: Response(b'x' * (2 << 20)))
    write = prep.atomic_write

    @contextlib.contextmanager
    def full_disk(path):
        with write(path) as f:
            def no_space(chunk):
                raise OSError(errno.ENOSPC, 'No space left on device')
            f.write = no_space
            yield f
    monkeypatch.setattr(prep, 'atomic_write', full_disk)
    message = fails('--dataset=enwik8', f'--data_dir={tmp_path / "data"}', f'--out_dir={tmp_path / "out"}')
    assert message.startswith(f"error: no space left on the device for {tmp_path / 'data' / 'enwik8' / 'enwik8.zip'}")
    assert 'by hand' not in message
    assert not (tmp_path / 'data').exists()


def test_wrong_archive_is_reported_and_kept(corpora, monkeypatch):
    data, _ = corpora
    monkeypatch.setitem(prep.SOURCES, 'enwik8', dict(prep.SOURCES['enwik8'], size=10**8))
    # --max_iters=1: a check that let the archive through would fail fast, not train a whole run
    message = fails('--dataset=enwik8', f'--data_dir={data}', f'--out_dir={data / "out"}', '--max_iters=1')
    assert 'expected 100,000,000 bytes' in message and 'delete it' in message
    assert message.startswith(f"error: {data / 'enwik8' / 'enwik8.zip'}: enwik8 is ")   # which file
    assert os.path.exists(data / 'enwik8' / 'enwik8.zip')


def test_text8_with_a_symbol_outside_its_vocabulary_is_refused(tmp_path, monkeypatch):
    data = b'abc def A' * 400
    os.makedirs(tmp_path / 'text8')
    with zipfile.ZipFile(tmp_path / 'text8' / 'text8.zip', 'w') as z:
        z.writestr('text8', data)
    monkeypatch.setitem(prep.SOURCES, 'text8', dict(prep.SOURCES['text8'], size=len(data),
                                                    digest=('sha1', hashlib.sha1(data).hexdigest())))
    with pytest.raises(SystemExit, match="holds bytes outside its 27-symbol vocabulary"):
        prep.prepare('text8', str(tmp_path))


def test_two_files_of_one_name_prepared_at_once_keep_their_own_data(tmp_path, capsys):
    """x/notes.txt and y/notes.txt, prepared at the same time into one data_dir, each go into a
    folder of their own, named after the file and printed; and two preparations of one file at
    once take turns (an flock), both ending with the folder whole."""
    data = tmp_path / 'data'
    files = [text_file(tmp_path / d / 'notes.txt', seed) for seed, d in enumerate('xyx')]
    procs = [subprocess.Popen([sys.executable, 'data/prepare.py', str(f), f'--data_dir={data}'], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in files]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    folders = [out.split(':')[1].strip() for out, _ in outputs]   # "notes.txt: <folder>: train ..."
    assert folders[0] == folders[2] != folders[1] and sorted(os.listdir(data)) == sorted(map(os.path.basename, folders[:2]))
    for f, folder in zip(files, folders):
        meta = json.loads((pathlib.Path(folder) / 'meta.json').read_text())
        ids = np.concatenate([np.fromfile(pathlib.Path(folder) / f'{s}.bin', dtype=np.uint8) for s in meta['splits']])
        assert meta['source'] == str(f) and bytes(np.array(meta['vocab'], dtype=np.uint8)[ids]) == f.read_bytes()
    text_file(files[1], seed=7)   # the file changed: its folder no longer matches it, and is prepared again
    capsys.readouterr()
    prep.main([str(files[1]), f'--data_dir={data}'])
    assert f'prepared {folders[1]}' in capsys.readouterr().err


def test_a_damaged_split_is_noted_and_prepared_again_never_used(checkpointed, tmp_path, data_dir, monkeypatch, capsys):
    """A split overwritten with valid ids of the same size, or with ids past the vocabulary (0xFF),
    even with meta.json's digest made to match: the run notes it and prepares it again from its
    source, and scores what it scored before. Where the source is gone (an archive deleted,
    no network), one line."""
    out = copy_of(checkpointed, tmp_path)

    def main(script, *argv):   # what it printed: (stdout, stderr)
        capsys.readouterr()
        script.main([f'--out_dir={out}', f'--data_dir={data_dir}', *argv])
        return capsys.readouterr()
    good = main(ec, '--batch_size=1024')
    assert 'SHA-256' not in good.err, good.err[-2000:]
    folder = pathlib.Path(data_dir) / 'shakespeare'
    val = np.fromfile(folder / 'val.bin', dtype=np.uint8)
    np.random.default_rng(0).permutation(val).tofile(folder / 'val.bin')   # valid ids, the same size
    again = main(ec, '--batch_size=1024')
    assert json.loads(again.out) == json.loads(good.out), again.err[-2000:]
    assert f'note: {folder}: val.bin does not match its SHA-256 in meta.json' in again.err
    assert np.array_equal(np.fromfile(folder / 'val.bin', dtype=np.uint8), val)

    train = np.fromfile(folder / 'train.bin', dtype=np.uint8)
    train[100:200] = 0xFF   # past the 80-symbol vocabulary: an IndexError in the embedding, once
    train.tofile(folder / 'train.bin')
    result = main(tc, '--init_from=resume', '--max_iters=9')
    assert 'train.bin does not match its SHA-256' in result.err, result.err[-2000:]
    train[100:200] = 0xFF
    train.tofile(folder / 'train.bin')
    meta = json.loads((folder / 'meta.json').read_text())
    meta['sha256']['train'] = prep.hashlib.sha256(train).hexdigest()   # a digest that matches the damage
    meta['self_sha256'] = prep.meta_digest(meta)   # and meta.json's own, made to match too
    (folder / 'meta.json').write_text(json.dumps(meta))
    result = main(tc, '--init_from=resume', '--max_iters=10')
    assert 'train.bin holds token id 255, past its 80-symbol vocabulary' in result.err, result.err[-2000:]
    assert np.fromfile(folder / 'train.bin', dtype=np.uint8).max() < 80

    make_corpora(str(tmp_path / 'data'), monkeypatch, as_prepared=True)   # enwik8.zip in place, no network
    prep.prepare('enwik8', str(tmp_path / 'data'))
    os.remove(tmp_path / 'data' / 'enwik8' / 'enwik8.zip')
    (tmp_path / 'data' / 'enwik8' / 'test.bin').write_bytes(b'\0' * 200)
    with pytest.raises(SystemExit, match='could not download http://127.0.0.1:9/unreachable.zip'):
        dataset.load_dataset('enwik8', str(tmp_path / 'data'))


def test_a_link_as_a_prepared_split_is_refused_and_left_alone(tmp_path):
    """A symbolic link where a preparation writes a split: one line naming it; the file it points
    to is unchanged and the link stays."""
    text, data = text_file(tmp_path / 'notes.txt', seed=1, size=2000), tmp_path / 'data'
    victim = tmp_path / 'thesis.txt'
    victim.write_text('years of work')
    folder = pathlib.Path(prep.text_file_dir(str(text), str(data)))
    folder.mkdir(parents=True)
    (folder / 'val.bin').symlink_to(victim)
    assert f'{folder}/val.bin is a symbolic link: refusing to write through it; remove it' in fails(
        text, f'--data_dir={data}', main=prep.main)
    assert victim.read_text() == 'years of work' and (folder / 'val.bin').is_symlink()


def test_a_dead_preparations_partial_files_are_removed_and_a_live_ones_kept(tmp_path):
    """Preparing a folder removes the partial files that a killed preparation left (the project's
    pattern, with or without its random part, of a process that no longer exists), never a live
    process's, a link of that name or a user's file."""
    text, data = text_file(tmp_path / 'notes.txt', seed=1, size=2000), tmp_path / 'data'
    prep.main([str(text), f'--data_dir={data}'])
    folder = pathlib.Path(prep.text_file_dir(str(text), str(data)))
    gone = subprocess.Popen(['true'])
    gone.wait()   # its pid now names no process
    dead = [f'train.bin.damcha-partial-{gone.pid}-0123abcd.tmp', f'val.bin.damcha-partial-{gone.pid}.tmp']
    kept = [f'train.bin.damcha-partial-{os.getpid()}-89abcdef.tmp', 'notes.damcha-partial.tmp',
            f'test.bin.damcha-partial-{gone.pid}-0123abcd.tmp.bak']
    for name in dead + kept:
        (folder / name).write_bytes(b'half a split')
    link = folder / f'meta.json.damcha-partial-{gone.pid}-4567cdef.tmp'
    link.symlink_to(text)
    text_file(text, seed=2, size=2000)   # changed: the next use prepares the folder again
    prep.main([str(text), f'--data_dir={data}'])
    assert sorted(os.listdir(folder)) == sorted(kept + [link.name, 'meta.json', 'train.bin', 'val.bin', 'test.bin'])


def test_a_damaged_meta_json_is_named_and_prepared_again(checkpointed, tmp_path, data_dir, capsys):
    """One flipped bit in meta.json's vocabulary ('t' to 'u') fails its self_sha256: eval names
    meta.json as damaged, prepares it again from its source and scores what it scored before;
    nothing blames the text."""
    out = copy_of(checkpointed, tmp_path)

    def scores():   # (its JSON, its stderr)
        capsys.readouterr()
        ec.main([f'--out_dir={out}', f'--data_dir={data_dir}', '--batch_size=1024'])
        printed, err = capsys.readouterr()
        return json.loads(printed), err
    good, _ = scores()
    path = pathlib.Path(data_dir) / 'shakespeare' / 'meta.json'
    meta = json.loads(path.read_text())
    meta['vocab'][meta['vocab'].index(ord('t'))] ^= 1
    path.write_text(json.dumps(meta))
    again, err = scores()
    assert again == good and f'note: {path} is damaged (it does not match its self_sha256)' in err, err[-2000:]
    assert 'outside' not in err and json.loads(path.read_text())['vocab'] == dataset.load_dataset('shakespeare', str(data_dir))[1]


def test_a_fifo_as_meta_json_is_named_without_hanging(tmp_path):
    """A FIFO where a prepared folder's meta.json belongs is named in one line, never opened
    (reading it would wait for a writer forever) nor replaced."""
    text, data = text_file(tmp_path / 'notes.txt', seed=1, size=2000), tmp_path / 'data'
    folder = pathlib.Path(prep.text_file_dir(str(text), str(data)))
    folder.mkdir(parents=True)
    os.mkfifo(folder / 'meta.json')
    one_line_error(cli(str(text), f'--data_dir={data}', script='data/prepare.py', timeout=60),
                   f'{folder}/meta.json is a FIFO (named pipe), not a file of a prepared dataset: remove it')
    assert stat.S_ISFIFO(os.lstat(folder / 'meta.json').st_mode)


def test_a_source_made_private_after_its_preparation_makes_its_folder_private(tmp_path):
    """A text file prepared while others could read it, then made private (chmod 600): its next
    use leaves the prepared folder open to its owner alone, as a fresh preparation of it would."""
    text, data = text_file(tmp_path / 'notes.txt', seed=1, size=2000), tmp_path / 'data'
    text.chmod(0o644)
    prep.main([str(text), f'--data_dir={data}'])
    folder = pathlib.Path(prep.text_file_dir(str(text), str(data)))
    assert stat.S_IMODE(folder.stat().st_mode) & 0o055 == 0o055
    text.chmod(0o600)
    prep.main([str(text), f'--data_dir={data}'])
    assert stat.S_IMODE(folder.stat().st_mode) & 0o077 == 0
