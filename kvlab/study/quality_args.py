"""The sizes of a format benchmark's two quality tasks, WikiText-2 perplexity and greedy agreement: their
command-line arguments and the report's sentence naming them.

    add_quality_args(parser, context=512, num_windows=8, prompt_length=64)
    quality_sizes(args, "against the fp32 cache")
"""

from __future__ import annotations

import argparse


def add_quality_args(p: argparse.ArgumentParser, context: int, num_windows: int, prompt_length: int) -> None:
    """The sizes of a format benchmark's two quality tasks: WikiText-2 perplexity and agreement."""
    p.add_argument("--context", type=int, default=context, help="perplexity: context tokens per window")
    p.add_argument("--continuation", type=int, default=64, help="perplexity: scored tokens per window")
    p.add_argument("--num-windows", type=int, default=num_windows)
    p.add_argument("--num-prompts", type=int, default=4, help="agreement: prompts")
    p.add_argument("--prompt-length", type=int, default=prompt_length)
    p.add_argument("--max-new-tokens", type=int, default=32, help="agreement: greedy tokens compared")


def quality_sizes(args, reference: str) -> str:
    """The report's sentence on the quality tasks' sizes (the arguments of add_quality_args)."""
    return (f"Perplexity: WikiText-2 test, {args.num_windows} windows of {args.context} context + {args.continuation} "
            f"scored tokens. Agreement: {args.num_prompts} prompts of {args.prompt_length} tokens, "
            f"{args.max_new_tokens} greedy tokens, {reference}. ")
