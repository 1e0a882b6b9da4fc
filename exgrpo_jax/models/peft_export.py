"""A LoRA run's adapters as a PEFT adapter directory, for transformers / vLLM serving.

  write_adapter(cfg, lora_params, dst, base_model_name_or_path)

writes `adapter_config.json` and `adapter_model.safetensors` in PEFT's layout, which
`peft.PeftModel.from_pretrained(base_hf_model, dst)` loads onto the Hugging Face base
model: per layer i and target, `base_model.model.model.layers.{i}.<module>.<target>.
lora_A.weight` [r, in] and `lora_B.weight` [out, r], with PEFT's scale lora_alpha / r
equal to the run's alpha / rank. `in` and `out` flatten the weight's head axes as the HF
weight does (`hf_keys`: q_proj's [D, H, Dh] is HF's [H*Dh, D]), so A @ B in PEFT's
layout is the run's update of the HF weight.

`export.save_pretrained` writes this directory as `adapter/` beside the merged model.
"""

import json
import os

import jax
import numpy as np

from exgrpo_jax.models import config as config_lib
from exgrpo_jax.models import lora
from exgrpo_jax.models import safetensors_io

ADAPTER_DIR = "adapter"
# Each target's module in the HF model (`hf_keys`' names).
_HF_MODULE = {"attn": "self_attn", "mlp": "mlp"}


def adapter_state_dict(cfg: config_lib.ModelConfig, params: lora.LoraParams,
                       dtype: str = "float32") -> dict[str, np.ndarray]:
  """{PEFT key: array} of every layer's A [r, in] and B [out, r]."""
  np_dtype = np.dtype(config_lib.dtype_from_name(dtype))
  out = {}
  for module, targets in params.adapters["layers"].items():
    for name, ab in targets.items():
      a_Lx_in_xr, b_Lxrx_out = (np.asarray(jax.device_get(ab[k]), np.float32)
                                for k in ("a", "b"))
      L, r = a_Lx_in_xr.shape[0], a_Lx_in_xr.shape[-1]
      a_LxrxI = a_Lx_in_xr.reshape(L, -1, r).transpose(0, 2, 1)
      b_LxOxr = b_Lxrx_out.reshape(L, r, -1).transpose(0, 2, 1)
      for i in range(cfg.num_layers):
        key = f"base_model.model.model.layers.{i}.{_HF_MODULE[module]}.{name}"
        out[f"{key}.lora_A.weight"] = np.ascontiguousarray(a_LxrxI[i].astype(np_dtype))
        out[f"{key}.lora_B.weight"] = np.ascontiguousarray(b_LxOxr[i].astype(np_dtype))
  return out


def adapter_config(params: lora.LoraParams, base_model_name_or_path: str) -> dict:
  """PEFT's LoraConfig fields for these adapters (no dropout, no bias, plain scaling)."""
  rank = next(iter(jax.tree.leaves(params.adapters))).shape[-1]
  targets = sorted(name for targets in params.adapters["layers"].values() for name in targets)
  return dict(peft_type="LORA", task_type="CAUSAL_LM", r=int(rank),
              lora_alpha=float(params.scale * rank), target_modules=targets,
              lora_dropout=0.0, bias="none", fan_in_fan_out=False, use_rslora=False,
              use_dora=False, init_lora_weights=True, inference_mode=True,
              base_model_name_or_path=base_model_name_or_path)


def write_adapter(cfg: config_lib.ModelConfig, params: lora.LoraParams, dst: str,
                  base_model_name_or_path: str = "", dtype: str = "float32") -> str:
  """Writes the PEFT adapter directory `dst` (created if missing); returns it."""
  os.makedirs(dst, exist_ok=True)
  safetensors_io.save_file(adapter_state_dict(cfg, params, dtype),
                           os.path.join(dst, "adapter_model.safetensors"),
                           metadata={"format": "pt"})
  with open(os.path.join(dst, "adapter_config.json"), "w", encoding="utf-8") as f:
    json.dump(adapter_config(params, base_model_name_or_path), f, indent=2)
  return dst
