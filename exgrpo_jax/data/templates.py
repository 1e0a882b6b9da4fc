"""Prompt templates by name, and rendering questions to token ids.

  chat          the tokenizer's chat template on the file's messages
                (`remove_system=True` drops system messages, as the reference's eval does)
  exgrpo_think  ExGRPO's system prompt + the problem through the chat template, then
                "<think>\\n" (without a chat template, the paper's App. G.1 text form)
  plain         "User: {problem}\\nAssistant:" (base models)

A prompt that ends with "<think>" turns on the reward's think gate (see
`rewards.graders.grade`), whichever template produced it.
"""

import dataclasses
from typing import Sequence

from exgrpo_jax import registry
from exgrpo_jax.data import questions as questions_lib
from exgrpo_jax.rewards import graders

TEMPLATES = registry.Registry("prompt template")

# The system prompt of every ExGRPO/LUFFY parquet file (exgrpo_*.parquet, ood_*.parquet).
EXGRPO_SYSTEM_PROMPT = (
    "Your task is to follow a systematic, thorough reasoning process before providing the "
    "final solution. This involves analyzing, summarizing, exploring, reassessing, and "
    "refining your thought process through multiple iterations. Structure your response "
    "into two sections: Thought and Solution. In the Thought section, present your "
    "reasoning using the format: \"<think>\n {thoughts} </think>\n\". Each thought should "
    "include detailed analysis, brainstorming, verification, and refinement of ideas. "
    "After \"</think>\n,\" in the Solution section, provide the final, logical, and "
    "accurate answer, clearly derived from the exploration in the Thought section. If "
    "applicable, include the answer in \\boxed{} for closed-form results like multiple "
    "choices or mathematical solutions.")


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A rendered question: token ids, text, and whether the think gate applies."""

  question: questions_lib.Question
  ids: tuple[int, ...]
  text: str
  think_gate: bool


def _chat(tokenizer, messages) -> str:
  if not tokenizer.chat_template:
    raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; use the "
                     "'plain' template (or 'exgrpo_think')")
  return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                       add_generation_prompt=True)


@TEMPLATES.register("chat")
def chat(question: questions_lib.Question, tokenizer, remove_system: bool = False) -> str:
  """The file's messages through the tokenizer's chat template."""
  messages = [m for m in question.messages if not (remove_system and m["role"] == "system")]
  return _chat(tokenizer, messages)


@TEMPLATES.register("exgrpo_think")
def exgrpo_think(question: questions_lib.Question, tokenizer,
                 remove_system: bool = False) -> str:
  """ExGRPO's system prompt and the problem; the generation prompt ends "<think>\\n"."""
  del remove_system  # the template is defined by its system prompt
  if not tokenizer.chat_template:
    return (f"{EXGRPO_SYSTEM_PROMPT}\n\nUser: This is the problem: {question.problem} "
            f"Assistant: {graders.THINK_OPEN}\n")
  messages = [{"role": "system", "content": EXGRPO_SYSTEM_PROMPT},
              {"role": "user", "content": question.problem}]
  return _chat(tokenizer, messages) + graders.THINK_OPEN + "\n"


@TEMPLATES.register("plain")
def plain(question: questions_lib.Question, tokenizer, remove_system: bool = False) -> str:
  """For base models: `User: {problem}\\nAssistant:` (no system prompt)."""
  del tokenizer, remove_system
  return f"User: {question.problem}\nAssistant:"


def render_prompts(questions: Sequence[questions_lib.Question], tokenizer,
                   template: str = "chat", max_prompt_tokens: int = 0,
                   remove_system: bool = False) -> tuple[list[Prompt], int]:
  """Renders and tokenizes questions; returns (prompts, number dropped as too long).

  A rendered text that already starts with the tokenizer's BOS (chat templates that
  include it) is encoded without special tokens, anything else with them, so BOS
  appears exactly once for tokenizers that use one.
  """
  render = TEMPLATES.get(template)
  texts = [render(q, tokenizer, remove_system) for q in questions]
  unique = list(dict.fromkeys(texts))  # the AIME/AMC rows repeat their prompt 32 times
  bos = tokenizer.bos_token
  ids_of = {}
  for add_special in (False, True):
    group = [t for t in unique if bool(bos and t.startswith(bos)) != add_special]
    if group:
      ids_of.update(zip(group, tokenizer(group, add_special_tokens=add_special)["input_ids"]))
  prompts, dropped = [], 0
  for q, text in zip(questions, texts):
    ids = ids_of[text]
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
      dropped += 1
      continue
    prompts.append(Prompt(q, tuple(ids), text, graders.ends_with_think(text)))
  return prompts, dropped
