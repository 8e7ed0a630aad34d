"""
configurator.py: the one settings parser of every script, in the manner of nanoGPT's configurator,
standard library only. A script keeps its settings in a dict of defaults and calls
configure(defaults, sys.argv[1:]); each argument, in order, overrides what came before:
    config/enwik8.py      a config file of plain assignments (key = value), run as Python
    --key=value           a Python literal of the default's type (an int where a float is due)
    --flag                short for --flag=True, for settings whose default is a bool
    --help                the script's docstring, then every setting, its default and the comment
                          beside that default in the script's source (describe); the settings
                          a checkpoint supplies are listed apart, without defaults
Bad input ends the program with one line on stderr (shell.die), never a traceback; the settings of
a run, given or saved in a checkpoint, are checked alike (settings_problem).
"""
import ast
import difflib
import math
import os
import re
import sys
import types

from shell import die, not_a_file, pipe_closed


def configure(defaults, argv, choices=None, positive=(), non_negative=(), doc=None,
              described_in=None, from_checkpoint=()):
    """defaults updated by each config file or --key=value of argv in order; choices: {key: allowed
    values}; positive / non_negative: keys whose numbers are checked; described_in: the source files
    whose comments describe the settings for --help (default: the script); from_checkpoint: the
    keys a checkpoint supplies unless given, whose defaults --help leaves out. Returns
    (config, keys given)."""
    config, given = dict(defaults), set()
    for arg in argv:
        if arg in ('-h', '--help'):
            print_help(doc, defaults, described_in or [sys.argv[0]], from_checkpoint)
        if arg.startswith('--'):
            key, eq, text = arg[2:].partition('=')
            if not eq and type(defaults.get(key)) is bool:
                text = 'True'
            elif not eq and key in defaults:   # an unknown --key is said below, with a suggestion
                die(f"{arg}: options are written --key=value")
            updates, from_text = {key: text}, True
        elif arg.startswith('-'):   # -x, a single dash: an option mistyped, never a file to run
            die(f"{arg}: no such option (options are written --key=value; --help lists them)"
                + (f"; a file of that name is written ./{arg}" if os.path.exists(arg) else ''))
        elif not_a_file(arg):
            die(f"{arg} is {not_a_file(arg)}, not a config file")
        elif os.path.isfile(arg):
            updates, from_text = read_config_file(arg), False
        else:
            die(f"{arg}: no such config file (options are written --key=value)")
        for key, value in updates.items():
            if key not in defaults:
                close = difflib.get_close_matches(key, defaults, n=1)
                die(f"unknown setting {key!r} in {arg}"
                    + (f"; did you mean {close[0]!r}?" if close else ''))
            config[key] = typed(key, value, type(defaults[key]), from_text)
            given.add(key)
    wrong = problem(config, choices, positive, non_negative)
    if wrong:
        die(wrong)
    return config, given


def print_help(doc, defaults, described_in, from_checkpoint):
    """--help: the script's docstring, then each setting with its default and description; the
    settings a checkpoint supplies come last, without their defaults, which a run read from a
    checkpoint never uses (a script's model defaults would mislead a reader of its help)."""
    about = describe(described_in, defaults)
    own = {k: f'{k}={v!r}' for k, v in defaults.items() if k not in from_checkpoint}
    saved = {k: k for k in defaults if k in from_checkpoint}
    width = min(30, max(map(len, [*own.values(), *saved.values()])))
    lines = lambda settings: [f'  {s:<{width}}  {about.get(k, "")}'.rstrip()
                              for k, s in settings.items()]
    text = [(doc or '').strip(), '', 'settings, with their defaults (--key=value):', *lines(own)]
    if saved:
        text += ["settings the checkpoint supplies, its run's data and model, unless given "
                 "(--key=value):", *lines(saved)]
    try:
        print('\n'.join(text), flush=True)
    except BrokenPipeError:   # --help | head
        pipe_closed()
    raise SystemExit(0)


def problem(config, choices=None, positive=(), non_negative=()):
    """What is wrong with config's values, in one line, or None: a value outside its choices, or a
    number that is not finite, not positive or negative."""
    for key, allowed in (choices or {}).items():
        if config[key] not in allowed:
            return f"{key} must be one of {', '.join(map(str, allowed))}, not {config[key]!r}"
    for key in tuple(positive) + tuple(non_negative):
        # nan passes every comparison below; inf reaches the libraries
        if not math.isfinite(config[key]):
            return f"{key} must be a finite number, not {config[key]}"
        if config[key] < 0 or (config[key] == 0 and key in positive):
            return (f"{key} must be {'positive' if key in positive else 'zero or more'}, "
                    f"not {config[key]}")
    return None


def describe(paths, names):
    """{name: description} of the settings `names`: the comment beside each default in these source
    files, `name=default,  # text` or `name: type = default  # text`, with the comment lines aligned
    below it that go on with the text. The first file, and line, that describes a name wins."""
    about = {}
    for path in paths:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:   # no source to read (python -c): no descriptions from it
            continue
        name = None
        for line in lines:
            code, _, text = line.partition('  # ')
            match = re.fullmatch(r'\s*(\w+)\s*(:[^=]*)?=.*', code)
            if text and match and match[1] in names and match[1] not in about:
                name, column = match[1], len(code)
                about[name] = text.strip()
            elif text and name and not code.strip() and len(code) == column:   # the text goes on
                about[name] += ' ' + text.strip()
            else:
                name = None
    return about


def read_config_file(path):
    """The assignments of a config file, except names starting with an underscore and the modules
    it imports (import math, to compute a value, sets no setting)."""
    namespace = {}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, 'exec'), namespace)
    except Exception as e:   # whatever a broken config file raises, report it in one line
        die(f"{path}: {type(e).__name__}: {e}")
    except SystemExit as e:
        # exit() in a config file would end the script in silence, having run nothing
        die(f"{path}: exits (SystemExit: {e.code!r}) instead of setting values")
    return {k: v for k, v in namespace.items()
            if not k.startswith('_') and not isinstance(v, types.ModuleType)}


def typed(key, value, want, from_text):
    """value with the type want; from_text: value is the text of a --key=value flag."""
    if from_text and want is not str:
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            if (want is not float
                    or value.strip().lower().lstrip('+-') not in ('nan', 'inf', 'infinity')):
                die(f"{key}={value}: expected {want.__name__}"
                    + (" (True or False)" if want is bool else ''))
            value = float(value)   # a number, if not a finite one: refused below as such
    if want is float and type(value) is int:
        value = float(value)
    if type(value) is not want:
        die(f"{key}={value!r}: expected {want.__name__}, not {type(value).__name__}")
    # nan passes every comparison; inf reaches the libraries
    if want is float and not math.isfinite(value):
        die(f"{key} must be a finite number, not {value}")
    return value


def settings_problem(cfg, ranges):
    """What is wrong with a run's settings, in one line, or None; those given and those a checkpoint
    saved are checked alike. ranges = (choices, positive, non_negative) as configure() takes them;
    out_dir names a folder (several, comma-separated, for a plot); the seed is one torch and numpy
    both take; Adam's rates, in a script that has them."""
    wrong = problem(cfg, *ranges)
    if wrong:
        return wrong
    if not [d for d in cfg['out_dir'].split(',') if d.strip()]:
        return f"out_dir={cfg['out_dir']!r} names no folder"
    if not 0 <= cfg['seed'] < 2**32:   # torch.manual_seed takes seed + rank, numpy up to 2**32 - 1
        return f"seed={cfg['seed']} must be a whole number from 0 to 2**32 - 1"
    for key in ('beta1', 'beta2'):   # Adam's moment decay rates
        if key in cfg and not 0 <= cfg[key] < 1:
            return f"{key}={cfg[key]} must be at least 0 and below 1, e.g. 0.9"
    return None


def check_run_settings(cfg, ranges):
    wrong = settings_problem(cfg, ranges)
    if wrong:
        die(wrong)
