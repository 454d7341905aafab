"""The seeded synthetic workload of `kvserve bench serve`: prompts of random common words
(lengths in tokens, corrected by a calibration against the server's tokenizer) and the
Poisson arrival times at which they are sent."""
from __future__ import annotations

import random
from dataclasses import dataclass

from cluster.workload.draws import sample_lengths

DATASETS = ("random", "shared-prefix")

# Short, common English words: one token each in most BPE vocabularies (a leading space
# included). A server's tokenizer may still split some; `calibrate_prompt_tokens` measures
# the real ratio and the generator corrects for it.
WORDS: tuple[str, ...] = tuple(
    """the of and to in is it you that he was for on are with as his they be at one have
    this from or had by word but what some we can out other were all there when up use your
    how said an each she which do their time if will way about many then them write would
    like so these her long make thing see him two has look more day could go come did number
    sound no most people my over know water than call first who may down side been now find
    any new work part take get place made live where after back little only round man year
    came show every good me give our under name very through just form great think say help
    low line turn cause much mean before move right boy old too same tell does set three want
    air well also play small end put home read hand port large add even land here must big
    high such follow act why ask men change went light kind off need house try us again point
    mother world near build self earth father head stand own page should country found answer
    school grow study still learn plant cover food sun four between state keep eye never last
    let thought city tree cross farm hard start might story saw far sea draw left late run
    while press close night real life few north open seem together next white children begin
    got walk example ease paper group always music those both mark often letter until mile
    river car feet care second book carry took science eat room friend began idea fish
    mountain stop once base hear horse cut sure watch color face wood main enough plain girl
    usual young ready above ever red list though feel talk bird soon body dog family direct
    pose leave song measure door product black short class wind question happen complete ship
    area half rock order fire south problem piece told knew pass since top whole king space""".split()
)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `prompt_len` is the length asked for (tokens); the
    server's `usage` gives the real one."""

    index: int
    prompt: str
    prompt_len: int
    max_tokens: int
    group: int | None = None  # shared-prefix: the prefix group
    prefix_len: int = 0  # shared-prefix: asked length of the shared part (tokens)


@dataclass(frozen=True)
class PromptCalibration:
    """prompt_tokens ~= overhead_tokens + tokens_per_word * words, measured on the server
    (BOS, a chat template and words the tokenizer splits all show up here)."""

    tokens_per_word: float = 1.0
    overhead_tokens: float = 0.0

    def words_for(self, tokens: float) -> int:
        return max(1, round(tokens / self.tokens_per_word))


def random_text(rng: random.Random, num_words: int, first_word: str | None = None) -> str:
    words = [rng.choice(WORDS) for _ in range(num_words)]
    if first_word is not None and words:
        words[0] = first_word
    return " ".join(words)


def generate_workload(
    dataset: str = "random",
    *,
    num_prompts: int = 100,
    seed: int = 0,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    num_prefix_groups: int = 4,
    prefix_len: int = 512,
    suffix_len: int = 128,
    calibration: PromptCalibration = PromptCalibration(),
) -> list[BenchRequest]:
    """A seeded synthetic workload (the same arguments give the same prompts).

    - "random": prompts of ~`input_len` tokens of random words, outputs of `output_len`
      tokens; both uniform within +-`range_ratio` of the mean.
    - "shared-prefix": `num_prefix_groups` prefixes of ~`prefix_len` tokens, each request
      one of them (round-robin, then shuffled) plus its own random suffix of ~`suffix_len`
      tokens (+-range_ratio); prefixes of different groups differ from the first word on.
    The calibration's overhead (BOS, chat template) is taken off the prompt (random) or
    the prefix (shared-prefix), so `prompt_len` is what the server should count.
    """
    if num_prompts < 0:
        raise ValueError("num_prompts must be >= 0")
    rng = random.Random(f"kvserve-bench:{dataset}:{seed}")
    cal = calibration
    if dataset == "random":
        in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
        out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
        return [
            BenchRequest(i, random_text(rng, cal.words_for(n - cal.overhead_tokens)), n, m)
            for i, (n, m) in enumerate(zip(in_lens, out_lens))
        ]
    if dataset == "shared-prefix":
        if num_prefix_groups < 1:
            raise ValueError("num_prefix_groups must be >= 1")
        if num_prefix_groups > len(WORDS):
            raise ValueError(f"at most {len(WORDS)} prefix groups")
        first_words = rng.sample(WORDS, num_prefix_groups)  # distinct: prefixes diverge at once
        prefix_words = cal.words_for(prefix_len - cal.overhead_tokens)
        prefixes = [random_text(rng, prefix_words, first_word=w) for w in first_words]
        groups = [i % num_prefix_groups for i in range(num_prompts)]
        rng.shuffle(groups)
        suffix_lens = sample_lengths(rng, num_prompts, suffix_len, range_ratio)
        out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
        requests = []
        for i, (g, s, m) in enumerate(zip(groups, suffix_lens, out_lens)):
            prompt = prefixes[g] + " " + random_text(rng, cal.words_for(s))
            requests.append(BenchRequest(i, prompt, prefix_len + s, m, group=g, prefix_len=prefix_len))
        return requests
    raise ValueError(f"unknown dataset {dataset!r} (one of {', '.join(DATASETS)})")
