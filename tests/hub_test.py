"""Models by hub id: `python -m exgrpo_jax.fetch` downloads a config's `model.hub_id` into
the Hugging Face cache and checks it; a run finds it there; a model whose rope settings
or positions cannot serve the config is refused before anything loads.

No network: huggingface_hub's download is replaced by a copy of the embedded SmolLM2's
HF directory into the cache's layout (refs/main, snapshots/<commit>/), which the real
huggingface_hub then finds offline (`local_files_only`), as it finds a downloaded copy.
"""

import json
import os
import runpy
import shutil
import subprocess
import sys

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub import utils as hf_utils
import pytest

from configs import qwen7b_lora
from exgrpo_jax import cli
from exgrpo_jax.models import hub
from exgrpo_jax.models import published
from exgrpo_jax.training import config_check
from exgrpo_jax.training import resume_check
from tests import conftest

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# What a run of configs/smollm2_135m.py needs to expect the hub's SmolLM2.
SMOLLM2_FLAGS = (f"--config.model.hub_id={SMOLLM2}",
                 "--config.model.path=checkpoints/SmolLM2-135M-Instruct")


def lay_out(source: str, cache: str, repo_id: str, allow, ignore) -> None:
  """`source`'s files that the patterns select, as huggingface_hub's cache holds a
  downloaded snapshot of `repo_id` (files linked, not copied)."""
  repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
  snapshot = os.path.join(repo, "snapshots", COMMIT)
  names = [os.path.relpath(os.path.join(d, f), source)
           for d, _, files in os.walk(source) for f in files]
  for name in hf_utils.filter_repo_objects(names, allow_patterns=allow,
                                           ignore_patterns=ignore):
    target = os.path.join(snapshot, name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if not os.path.lexists(target):  # a second download finds the first's files
      os.symlink(os.path.realpath(os.path.join(source, name)), target)
  os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
  with open(os.path.join(repo, "refs", "main"), "w", encoding="utf-8") as f:
    f.write(COMMIT)


def install_fake_download(source: str) -> None:
  """huggingface_hub.snapshot_download, downloading `source` instead of the hub's files."""
  real = huggingface_hub.snapshot_download

  def snapshot_download(repo_id, *, local_files_only=False, allow_patterns=None,
                        ignore_patterns=None, **kw):
    if not local_files_only:
      lay_out(source, constants.HF_HUB_CACHE, repo_id, allow_patterns, ignore_patterns)
    return real(repo_id, local_files_only=True, allow_patterns=allow_patterns,
                ignore_patterns=ignore_patterns, **kw)

  huggingface_hub.snapshot_download = snapshot_download


def fetch_child(source: str, *argv: str) -> None:
  """`python -m exgrpo_jax.fetch *argv` with the download replaced (a child process)."""
  install_fake_download(source)
  sys.argv = ["exgrpo_jax.fetch", *argv]
  runpy.run_module("exgrpo_jax.fetch", run_name="__main__")


@pytest.fixture
def hub_repo(tmp_path, smollm2_hf_dir):
  """The hub repository the fake download copies: SmolLM2's HF directory, plus the
  PyTorch copy a repository may also hold (which a run never reads)."""
  repo = tmp_path / "repo"
  (repo / "original").mkdir(parents=True)
  for name in os.listdir(smollm2_hf_dir):
    os.symlink(os.path.join(smollm2_hf_dir, name), repo / name)
  (repo / "original" / "consolidated.00.pth").write_bytes(b"not read")
  (repo / "pytorch_model.bin").write_bytes(b"not read")
  return str(repo)


def _run(*cmd, cache, timeout=300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *cmd], cwd=conftest.REPO_ROOT, capture_output=True,
                        text=True, timeout=timeout, check=False,
                        env=conftest.subprocess_env(HF_HUB_CACHE=str(cache)))


def test_fetch_downloads_checks_and_the_run_reads_it_by_hub_id(tmp_path, hub_repo):
  cache = tmp_path / "hf_cache"
  fetched = _run("-c", f"from tests import hub_test; hub_test.fetch_child({hub_repo!r}, "
                 "'--config=configs/smollm2_135m.py', "
                 + ", ".join(map(repr, SMOLLM2_FLAGS)) + ")", cache=cache)
  assert fetched.returncode == 0, fetched.stderr[-3000:]
  snapshot = cache / f"models--{SMOLLM2.replace('/', '--')}" / "snapshots" / COMMIT
  assert sorted(os.listdir(snapshot)) == sorted(
      n for n in os.listdir(hub_repo) if n not in ("original", "pytorch_model.bin"))
  lines = fetched.stdout.splitlines()
  assert lines[0] == f"{SMOLLM2}: {snapshot}", lines
  assert lines[1] == ("  llama (LlamaForCausalLM), 0.13B parameters: 30 layers, hidden 576, "
                      "9 heads (3 KV), vocab 49152"), lines
  assert lines[2].startswith("  8192 positions, rope_theta 100000.0, no rope scaling; the "
                             "config's responses: rollout.max_new_tokens 48"), lines
  assert "49152 tokens, a chat template" in lines[3], lines
  assert lines[4] == "  weights: 1 safetensors file, 272 tensors, every one the model reads"
  assert lines[5].startswith("checked: a run of this config reads it while model.path="
                             "checkpoints/SmolLM2-135M-Instruct is not on disk"), lines

  # The training CLI finds the cached copy by its hub id (and prints the config it would
  # run, without starting it).
  shown = _run("-m", "exgrpo_jax.train", "--config=configs/smollm2_135m.py", *SMOLLM2_FLAGS,
               "--print_config", cache=cache)
  assert shown.returncode == 0, shown.stderr[-3000:]
  assert json.loads(shown.stdout)["model"]["path"] == str(snapshot)
  assert f"reading model.hub_id={SMOLLM2} from the Hugging Face cache" in shown.stderr


def test_fetch_offline_checks_a_copy_in_the_cache_or_names_what_is_missing(tmp_path,
                                                                         smollm2_hf_dir):
  """A machine without the network (`HF_HUB_OFFLINE=1`, docs/first_run.md): the real
  huggingface_hub finds a copy carried into the cache, and fetch checks it; with none
  there, one line names the model and the cache, exit 1."""
  cache = tmp_path / "hf_cache"
  argv = ("-m", "exgrpo_jax.fetch", "--config=configs/smollm2_135m.py", *SMOLLM2_FLAGS)
  env = conftest.subprocess_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
  run = lambda: subprocess.run([sys.executable, *argv], cwd=conftest.REPO_ROOT, env=env,
                               capture_output=True, text=True, timeout=300, check=False)
  missing = run()
  assert missing.returncode == cli.EXIT_ERROR, missing.stderr[-3000:]
  assert missing.stderr.strip() == (f"exgrpo_jax.fetch: {SMOLLM2}: the hub cannot be reached "
                                    f"and the Hugging Face cache ({cache}) holds no copy")
  lay_out(smollm2_hf_dir, str(cache), SMOLLM2, hub.ALLOW_PATTERNS, hub.IGNORE_PATTERNS)
  found = run()
  assert found.returncode == 0, found.stderr[-3000:]
  snapshot = cache / f"models--{SMOLLM2.replace('/', '--')}" / "snapshots" / COMMIT
  assert found.stdout.splitlines()[0] == f"{SMOLLM2}: {snapshot}"
  assert found.stdout.splitlines()[-1].startswith("checked: a run of this config reads it")


def test_fetch_refuses_a_config_without_a_hub_id(tmp_path):
  proc = _run("-m", "exgrpo_jax.fetch", "--config=configs/smollm2_135m.py", cache=tmp_path)
  assert proc.returncode == cli.EXIT_USAGE
  assert proc.stderr.strip() == (
      "exgrpo_jax.fetch: config.model.hub_id='': names no model to fetch, and "
      "model.path='' is no local copy; set --config.model.hub_id=ORG/NAME")


def _edited_copy(source: str, dst, **changes) -> str:
  """`source` with its config.json changed by `changes` (other files linked)."""
  dst.mkdir()
  for name in os.listdir(source):
    if name != "config.json":
      os.symlink(os.path.join(source, name), dst / name)
  with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
    hf = json.load(f)
  (dst / "config.json").write_text(json.dumps(dict(hf, **changes)))
  return str(dst)


def _smollm2_config(path: str):
  config = qwen7b_lora.get_config()
  config.model.update(path=path, hub_id=SMOLLM2)
  config.rollout.max_new_tokens = config.eval.max_new_tokens = 512
  return config


def test_a_copy_unlike_the_published_model_fails_the_check(tmp_path, smollm2_hf_dir):
  facts, problems = hub.verify(smollm2_hf_dir, _smollm2_config(smollm2_hf_dir))
  assert problems == [] and len(facts) == 4
  changed = _edited_copy(smollm2_hf_dir, tmp_path / "changed", hidden_size=512,
                         rope_theta=10000.0, architectures=["Qwen2ForCausalLM"])
  os.remove(os.path.join(changed, "tokenizer.json"))
  os.remove(os.path.join(changed, "model.safetensors"))
  _, problems = hub.verify(changed, _smollm2_config(changed))
  assert problems[:3] == [
      "config.json: architectures ['Qwen2ForCausalLM'], expected LlamaForCausalLM for "
      "model_type 'llama'",
      f"config.json: hidden_size 512, {SMOLLM2} was published with 576",
      f"config.model.path={changed!r}: its config.json has rope_theta 10000.0, no rope "
      f"scaling; model.hub_id={SMOLLM2!r} was published with rope_theta 100000.0, no rope "
      "scaling, so this is another model: point model.path at that one (`python -m "
      "exgrpo_jax.fetch` fetches it), or train this one as it is with "
      "--config.model.hub_id="], problems
  assert problems[3].startswith("tokenizer: does not load"), problems
  assert problems[4] == f"weights: {changed}: no *.safetensors files (and no index.json)"
  assert len(problems) == 5


@pytest.fixture
def stock_qwen_math_7b(tmp_path):
  """The stock Qwen2.5-Math-7B's config.json (4,096 positions, rope_theta 10000) alone:
  the checks read nothing else."""
  path = tmp_path / "Qwen2.5-Math-7B"
  path.mkdir()
  (path / "config.json").write_text(json.dumps(
      dict(published.HF_CONFIGS["Qwen2.5-Math-7B"], architectures=["Qwen2ForCausalLM"])))
  return str(path)


def test_the_stock_7b_model_is_refused_before_anything_loads(tmp_path, stock_qwen_math_7b):
  """configs/qwen7b_lora.py (8,192-token responses, LUFFY's 16k-context model expected)
  on the stock Qwen2.5-Math-7B: exit 2, a line each for the rope settings and the
  response budgets of the rollout and the evaluation, nothing created, nothing
  compiled."""
  workdir = tmp_path / "run"
  proc = _run("-m", "exgrpo_jax.train", "--config=configs/qwen7b_lora.py:h200x1",
              f"--workdir={workdir}", f"--config.model.path={stock_qwen_math_7b}",
              cache=tmp_path / "hf_cache")
  assert proc.returncode == cli.EXIT_USAGE, proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  where = repr(stock_qwen_math_7b)
  assert ("exgrpo_jax.train: config.model.path=" + where + ": its config.json has rope_theta "
          "10000.0, no rope scaling; model.hub_id='Elliott/Qwen2.5-Math-7B-16k-think' was "
          "published with rope_theta 40000.0, no rope scaling, so this is another model: "
          "point model.path at that one (`python -m exgrpo_jax.fetch` fetches it), or train "
          "this one as it is with --config.model.hub_id=") in lines, lines
  for key in ("rollout", "eval"):
    assert (f"exgrpo_jax.train: config.{key}.max_new_tokens=8192: leaves no room for a "
            f"prompt in the 4096 positions of model.path={where} (max_position_embeddings of "
            "its config.json); lower it to 3072 (4096 less data.max_prompt_tokens=1024), or "
            "use a model with more positions") in lines, lines
  assert not os.path.exists(workdir)
  assert "compiling" not in proc.stderr and "Traceback" not in proc.stderr


def test_responses_that_fit_and_the_expected_rope_pass(stock_qwen_math_7b):
  config = qwen7b_lora.get_config()
  config.model.update(path=stock_qwen_math_7b, hub_id="Qwen/Qwen2.5-Math-7B")
  config.rollout.max_new_tokens = config.eval.max_new_tokens = 3072
  assert hub.config_problems(config) == []
  config.eval.max_new_tokens = 4096
  assert [l.split(":")[0] for l in hub.config_problems(config)] == [
      "config.eval.max_new_tokens=4096"]
  config.eval.every = 0  # no evaluation: its budget is not read
  assert hub.config_problems(config) == []


def test_a_missing_model_path_names_the_fetch_command(tmp_path, monkeypatch):
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
  config = qwen7b_lora.get_config()
  assert hub.use_cached(config) is None  # nothing in the cache: model.path stays
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(config)
  assert ("config.model.path='checkpoints/Qwen2.5-Math-7B-16k-think': no such file, and "
          "model.hub_id='Elliott/Qwen2.5-Math-7B-16k-think' is not in the Hugging Face "
          "cache; fetch it with `python -m exgrpo_jax.fetch` and this config's flags "
          "(docs/data.md, \"Models\")") in str(e.value).splitlines()


@pytest.mark.parametrize("name, hub_id", [
    ("qwen7b", "Elliott/Qwen2.5-Math-7B-16k-think"), ("qwen1_5b", "Qwen/Qwen2.5-Math-1.5B"),
    ("qwen7b_instruct", "Qwen/Qwen2.5-7B-Instruct"), ("llama8b", "meta-llama/Llama-3.1-8B"),
    ("llama8b_instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    ("qwen7b_lora", "Elliott/Qwen2.5-Math-7B-16k-think"),
    ("llama8b_lora", "meta-llama/Llama-3.1-8B")])
def test_the_paper_configs_name_their_models(name, hub_id):
  """Each paper config expects the hub model the paper trained, whose published
  architecture the planner prices (`model.path`'s last component)."""
  config = __import__(f"configs.{name}", fromlist=["get_config"]).get_config()
  assert config.model.hub_id == hub_id
  assert published.for_hub_id(hub_id) is published.HF_CONFIGS[
      os.path.basename(config.model.path)]


def test_a_download_without_the_network_is_one_line(monkeypatch, tmp_path):
  """No network and no cached copy: huggingface_hub's error becomes one line naming the
  model and the cache."""
  from huggingface_hub import errors  # pylint: disable=g-import-not-at-top

  def offline(repo_id, **kw):
    del repo_id, kw
    raise errors.LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder"
                                         "\nfor the specified revision on the local disk")

  monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
  with pytest.raises(ConnectionError) as e:
    hub.download(SMOLLM2)
  assert cli.one_line(e.value) == (f"{SMOLLM2}: the hub cannot be reached and the Hugging "
                                   f"Face cache ({tmp_path}) holds no copy")


def test_a_resume_may_drop_or_change_the_hub_id():
  """model.hub_id is what the model is checked against, not the model (model.path is)."""
  config = qwen7b_lora.get_config()
  saved = config.to_dict()
  config.model.hub_id = ""
  assert resume_check.check(saved, config) == []
