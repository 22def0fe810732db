"""`flashdraft train-drafter`'s settings: one dataclass whose fields are the command's flags."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    model: str | None = None
    out: str = "drafter"
    data: str | None = None  # jsonl of {"prompt_ids", "response_ids"}; generated when missing
    prompts: str | None = None  # comma-separated: jsonl files of prompts/messages, "sharegpt", "python"
    num_prompts: int | None = None
    prompt_turns: str = "first"  # ShareGPT prompts: "first" human turns, or "all" human turns with history
    samples_per_prompt: int = 1  # responses per prompt; more than 1 needs gen_temperature > 0
    gen_temperature: float = 0.0
    sampled_prefix: int = 0  # > 0: sample the first 0..N tokens at gen_temperature, then greedy (see data.py)
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    trim_loops: int | None = None  # cut each response this many tokens into the loop it ends in (data.trim_loop)
    arch: str = "dflash"  # "dflash2": convolutions around each sublayer and a candidate selector
    conv_kernel_size: int = 2  # dflash2: taps of each grouped causal convolution ...
    conv_group_size: int = 16  # ... and channels sharing one dynamic coefficient
    selector_rank: int = 256  # dflash2: the candidate selector's rank ...
    selector_top_k: int = 16  # ... and the candidates it re-scores
    selector_loss_weight: float = 1.0  # dflash2: weight of the selector's loss beside the drafter's
    num_layers: int = 3
    intermediate_size: int | None = None
    block_size: int | None = None  # None: 16 for a new drafter, the saved one's with init_drafter (a number
    # there changes it: the weights do not depend on the block size)
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    epochs: int = 6
    max_steps: int | None = None
    batch_size: int = 8
    num_anchors: int = 512
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str | None = None
    dtype: str = "bfloat16"
    save_every: int = 200
    keep_every: int | None = None  # also keep the drafter of every N-th step in out/steps/<step> (a learning curve)
    time_budget_s: float | None = None  # shorten the schedule to fit (rate measured at steps 10-30, 100-300)
    resume: bool = False
    gen_batch: int = 256
    precondition_taps: bool = True  # train on taps / RMS, fold the scale into the saved fc
    init_layers_from: int | None = None  # start the drafter layers from target layers N, N+1, ...
    init_drafter: str | None = None  # continue from a saved drafter folder (its shape and taps; a new schedule)
    add_layers: int = 0  # with init_drafter: layers appended after the saved ones (their outputs start at zero)
    local_context: int | None = None  # curriculum: blocks see only this many context positions ...
    local_context_frac: float = 0.1  # ... for this fraction of the steps
    labels: str = "data"  # slot targets: "data" tokens, the target's "argmax", or "kl" to its distribution
    walk_floor: float | None = None  # weight of the blocks off the walk a greedy verify takes (loss.walk_anchors)
    stop_after_s: float | None = None  # save and return once this many seconds have passed since train() began
    # (setup and data generation count), at a log step; --resume goes on
    log: list = field(default_factory=list, repr=False)
