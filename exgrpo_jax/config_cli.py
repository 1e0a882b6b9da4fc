"""The `--config=FILE.py[:ARG]` flag of the commands that take a config (train, aot).

  config_cli.make_config_files_importable(sys.argv)   # before defining the flag
  _CONFIG = config_flags.DEFINE_config_file("config", None, "...", lock_config=True)
  ...
  app.run(main, flags_parser=config_cli.flags_parser(_CONFIG, "exgrpo_jax.train"))

`flags_parser` is absl's flag parsing with one line and exit status 2 for a bad flag
(absl exits 1 with a usage hint, and a config key typo or a broken config file is a
traceback): the config file is loaded again to say what is wrong with it, and a
`--config.KEY` override naming no key gets the closest valid one (`unknown_key`).

A list-valued key (`model.lora.targets`) takes `a,b` or a Python list or tuple
(`ListParser`); ml_collections overrides no list by itself.
"""

import ast
import difflib
import importlib.util
import os
import re
import sys

from absl import flags
import ml_collections
from ml_collections import config_flags

from exgrpo_jax import cli


class ListParser(flags.ArgumentParser):
  """`--config.KEY=a,b`, `'(a, b)'` or `'["a", "b"]'` for a list-valued KEY (an empty
  value is the empty list)."""

  def parse(self, argument):
    if isinstance(argument, (list, tuple)):
      return list(argument)
    try:
      value = ast.literal_eval(argument)
    except (ValueError, SyntaxError):
      value = argument
    if isinstance(value, (list, tuple)):
      return list(value)
    return [part.strip() for part in str(value).split(",") if part.strip()]

  def flag_type(self):
    return "list"


config_flags.register_flag_parser_for_type(list, ListParser())


def make_config_files_importable(argv) -> None:
  """Config files import `configs.common`; puts the repository root of a `--config=`
  file on sys.path (call before absl parses the flags)."""
  for arg in argv:
    if arg.startswith("--config="):
      path = arg.split("=", 1)[1].split(":", 1)[0]
      root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
      if root not in sys.path:
        sys.path.insert(0, root)


def flatten(d: dict, prefix: str = "") -> dict:
  """{"section.key": value} of a nested dict (a config's `to_dict()`)."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def unknown_key(c, key: str) -> str | None:
  """Why `--config.<key>` names no key of config `c` (with the closest one), or None."""
  node = c
  for part in key.split("."):
    if not hasattr(node, "keys") or part not in node:
      known = list(flatten(c.to_dict()))
      leaf = key.rsplit(".", 1)[-1]
      close = ([k for k in known if k.rsplit(".", 1)[-1] == leaf] or
               difflib.get_close_matches(key, known, n=1, cutoff=0.5))
      hint = f"; did you mean --config.{close[0]}?" if close else ""
      return f"--config.{key}: no such config key{hint}"
    node = node[part]
  return None


def load(spec: str) -> ml_collections.ConfigDict:
  """The config of `FILE.py[:ARG]`, as `--config=` loads it (unlocked)."""
  path, _, arg = spec.partition(":")
  make_config_files_importable([f"--config={path}"])
  module_spec = importlib.util.spec_from_file_location("exgrpo_config_file", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(*([arg] if arg else []))


def config_problem(argv) -> str | None:
  """What is wrong with `--config` or a `--config.KEY` override in `argv`, found by
  loading the config file again (absl's own message is a traceback or names neither)."""
  specs = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
  if not specs:
    return None
  if not os.path.isfile(specs[-1].partition(":")[0]):
    return f"--config={specs[-1]}: no such file"
  try:
    config = load(specs[-1])
  except Exception as e:  # pylint: disable=broad-except
    return f"--config={specs[-1]}: {cli.one_line(e)}"
  for a in argv:
    key = re.match(r"--(?:no)?config\.([^=]+)", a)
    problem = key and unknown_key(config, key.group(1))
    if problem:
      return problem
  return None


def flags_parser(config_flag, prefix: str):
  """absl's flag parsing for `app.run(..., flags_parser=)`: a bad flag or config is one
  line `{prefix}: ...` and exit status 2; --help exits 0."""
  def parse(argv: list[str]) -> list[str]:
    try:
      rest = flags.FLAGS(argv)
      # A config file that failed to load (and no override touched it) is only a
      # placeholder that raises when read.
      problem = (None if isinstance(config_flag.value, ml_collections.ConfigDict)
                 else config_problem(argv))
      if len(rest) > 1:
        problem = f"unexpected arguments: {' '.join(rest[1:])}"
    except SystemExit:  # --help and its kin print the usage, then absl exits 1
      sys.exit(0)
    except Exception as e:  # pylint: disable=broad-except
      problem = config_problem(argv) or cli.one_line(e)
    if problem:
      print(f"{prefix}: {problem}", file=sys.stderr, flush=True)
      sys.exit(cli.EXIT_USAGE)
    return rest

  return parse
