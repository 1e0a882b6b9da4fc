"""Questions: data sources (files, generated arithmetic), readers (parquet, JSON, JSONL,
`datasets` directories, the hub; verl, TRL, GSM8K and problem columns), prompt templates,
and the resumable fresh-question stream."""

from exgrpo_jax.data import arithmetic
from exgrpo_jax.data import sources
from exgrpo_jax.data.questions import (BOXED_INSTRUCTION, DataError, LoadResult, Question,
                                       load_questions)
from exgrpo_jax.data.stream import QuestionStream
from exgrpo_jax.data.templates import EXGRPO_SYSTEM_PROMPT, TEMPLATES, Prompt, render_prompts
