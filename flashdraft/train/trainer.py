"""`flashdraft train-drafter`: self-distillation data from the target, then the DFlash recipe;
writes a z-lab-format checkpoint (config.json + model.safetensors) that flashdraft loads and
that follows the published layout (unpacked q/k/v and gate/up, no embed_tokens, no lm_head)."""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from flashdraft.models.loader import load_config, load_weights, resolve_model_dir
from flashdraft.train.config import TrainConfig
from flashdraft.train.distributed import average, check_in_sync, init_distributed
from flashdraft.train.drafter import (
    drafter_spec,
    grow_layers,
    grown_spec,
    init_drafter,
    init_from_target,
    save_checkpoint,
    widen_fc,
    wider_taps,
    with_arch,
)
from flashdraft.train.features import mlp_channel_energy, tap_scale, target_features
from flashdraft.train.loss import LABELS, dflash_loss, gamma_for, sample_anchors


def _mask_token(tokenizer, explicit: int | None) -> int:
    if explicit is not None:
        return explicit
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    raise ValueError("the tokenizer has no mask token: pass --mask-token-id (an id that never occurs in text)")


def _batches(samples, batch_size: int, rng: random.Random):
    order = list(range(len(samples)))
    rng.shuffle(order)
    # similar lengths together keeps padding low
    order = sorted(order, key=lambda i: len(samples[i][0]) // 64 + rng.random())
    groups = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    return groups


LOG_EVERY = 10  # steps between reads of the logged numbers from the GPU; the rate marks (10, 30, 100, 300) fall on them


def make_batch(seqs: list[tuple[list[int], int]], num_anchors: int, gen: torch.Generator, device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(prompt + response ids, prompt length)] -> ids [b, S] (right-padded), lengths [b], anchors
    and valid [b, N] (sample_anchors among the response tokens); all on device but the anchors, which
    stay on the CPU for dflash_loss to plan its attention groups from without waiting for the GPU."""
    s_max = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), s_max, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), s_max, dtype=torch.bool)
    for r, (s, p) in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
        loss_mask[r, p: len(s)] = True
    lengths = torch.tensor([len(s) for s, _ in seqs])
    anchors, valid = sample_anchors(loss_mask, lengths, num_anchors, gen)
    return (ids.to(device, non_blocking=True), lengths.to(device, non_blocking=True), anchors,
            valid.to(device, non_blocking=True))


def train(cfg: TrainConfig) -> Path:
    t_called = time.time()  # --stop-after bounds the whole command, setup (imports too) included
    from transformers import AutoModelForCausalLM

    from flashdraft.train.data import read_samples

    if cfg.labels not in LABELS:
        raise ValueError(f"unknown labels {cfg.labels!r}; use one of {', '.join(LABELS)}")
    if cfg.add_layers and not cfg.init_drafter:
        raise ValueError("add_layers grows a saved drafter: pass init_drafter too (a new drafter takes num_layers)")
    if cfg.sampled_prefix < 0 or (cfg.sampled_prefix and not cfg.gen_temperature):
        raise ValueError(f"sampled_prefix {cfg.sampled_prefix}: needs 0, or N > 0 with gen_temperature above 0 "
                         "to sample the prefix with")
    if cfg.trim_loops is not None and cfg.trim_loops < 0:
        raise ValueError(f"trim_loops must be 0 or more tokens, not {cfg.trim_loops}")
    if cfg.walk_floor is not None and not 0 <= cfg.walk_floor <= 1:
        raise ValueError(f"walk_floor must lie in [0, 1], not {cfg.walk_floor}")
    if cfg.keep_every is not None and cfg.keep_every < 1:
        raise ValueError(f"keep_every must be a positive number of steps, not {cfg.keep_every}")
    if cfg.block_size is not None and cfg.block_size < 2:
        raise ValueError(f"block_size {cfg.block_size}: a block holds the last token and at least one draft "
                         "(2 or more)")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rank, world, device = init_distributed(cfg)
    main = rank == 0
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.dtype]
    folder = resolve_model_dir(cfg.model, four_bit=False)  # (HF transformers reads it below)
    target_cfg = load_config(folder)
    from flashdraft.models.loader import load_tokenizer

    start = None
    if cfg.init_drafter:  # the saved drafter decides the shape (block size, layers, taps, mask token); taps,
        # add_layers and intermediate_size can grow it
        from flashdraft.speculative.loader import load_drafter

        if cfg.init_layers_from is not None:
            raise ValueError("pass either init_drafter or init_layers_from, not both")
        start = load_drafter(cfg.init_drafter, target_cfg, device, torch.float32)
        spec = start.spec
        untrainable = [name for name, on in (
            ("causal or sliding-window layers", any(m != (False, None) for m in spec.layer_masks or [])),
            ("input_embedding_scale", spec.input_embedding_scale != 1.0),
            ("output_multiplier / final_logit_softcapping",
             spec.output_multiplier != 1.0 or spec.final_logit_softcapping is not None),
            ("its own embed_tokens / lm_head", start.embed_tokens is not None or start.lm_head is not None)) if on]
        if untrainable:
            raise ValueError(f"train-drafter cannot continue {cfg.init_drafter}: its {', '.join(untrainable)} "
                             "are not in the training forward")
        spec = with_arch(replace(spec, layer_masks=None), cfg)  # arch dflash2 grows a DFlash drafter into one
        saved_taps = list(spec.target_layer_ids)
        if cfg.target_layer_ids and list(cfg.target_layer_ids) != saved_taps:  # more taps: fc widens (new ones at 0)
            spec = replace(spec, target_layer_ids=wider_taps(saved_taps, cfg.target_layer_ids,
                                                              target_cfg.num_hidden_layers))
        n_saved = spec.layer_config.num_hidden_layers
        spec = grown_spec(spec, cfg.add_layers, cfg.intermediate_size)  # deeper / narrower
        if cfg.block_size is not None:  # a longer (or shorter) block: same weights, more mask slots
            spec = replace(spec, block_size=cfg.block_size)
        cfg.block_size, cfg.num_layers = spec.block_size, spec.layer_config.num_hidden_layers
        cfg.target_layer_ids, cfg.mask_token_id = list(spec.target_layer_ids), spec.mask_token_id
        cfg.intermediate_size = spec.layer_config.intermediate_size
        mask_id = spec.mask_token_id
    else:
        mask_id = _mask_token(load_tokenizer(folder), cfg.mask_token_id)
        spec = drafter_spec(target_cfg, cfg, mask_id)
        cfg.block_size = spec.block_size
    # the shape is settled (and a bad option refused) above, before any data is generated
    data_path = Path(cfg.data) if cfg.data else out / "data.jsonl"
    if not data_path.exists():
        make_data(cfg, data_path, device, rank, world)
    samples = read_samples(data_path, cfg.trim_loops)
    if math.ceil(len(samples) / cfg.batch_size) < world:
        raise ValueError(f"{len(samples)} samples make {math.ceil(len(samples) / cfg.batch_size)} batches of "
                         f"{cfg.batch_size}; {world} data-parallel processes need at least one batch each")
    # the frozen target: HF transformers, taps = the outputs of the tapped layers (`hidden_states`)
    target = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval().requires_grad_(False)
    weights = load_weights(folder)
    embed = weights["model.embed_tokens.weight"].to(device, dtype)
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).to(device, dtype)
    drafter = init_drafter(spec, device, cfg.seed)
    with torch.no_grad():  # drafter output feeds the target's lm_head: start at the target's final-norm scale
        drafter.norm.weight.copy_(weights["model.norm.weight"])
    if cfg.init_layers_from is not None:
        if cfg.init_layers_from + cfg.num_layers > target_cfg.num_hidden_layers:
            raise ValueError(f"init_layers_from {cfg.init_layers_from} + {cfg.num_layers} layers exceeds the target's "
                             f"{target_cfg.num_hidden_layers}")
        init_from_target(drafter, weights, cfg.init_layers_from)
    if start is not None:
        energy = None
        if cfg.intermediate_size != start.spec.layer_config.intermediate_size:  # narrower: measure what to keep
            if main:
                start.setup(max(len(s[0]) for s in samples[:16]) + start.spec.block_size + 1)
                start.rope.cos, start.rope.sin = start.rope.cos.float(), start.rope.sin.float()
                energy = mlp_channel_energy(start, target, embed, samples, device, dtype)
            else:
                energy = torch.empty(n_saved, start.spec.layer_config.intermediate_size, device=device)
            if world > 1:  # every rank keeps rank 0's channels
                dist.broadcast(energy, 0)
        state = start.state_dict()
        state["fc.weight"] = widen_fc(state["fc.weight"], saved_taps, spec.target_layer_ids)
        state = grow_layers(state, n_saved, cfg.add_layers, cfg.intermediate_size, energy)
        missing = drafter.load_state_dict(state, strict=False).missing_keys  # DFlash2's parts: as initialised
        if any("_conv." not in k and not k.startswith("candidate_selector.") for k in missing) or \
                (missing and start.spec.selector is not None):
            raise ValueError(f"{cfg.init_drafter} lacks weights {missing[:4]}")
        del start, state
    max_len = max(len(s[0]) for s in samples) + cfg.block_size + 1
    drafter.setup(max_len)
    drafter.rope.cos, drafter.rope.sin = drafter.rope.cos.float(), drafter.rope.sin.float()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    # each rank takes every world-th batch of the same shuffled order; the tail that cannot be dealt
    # evenly waits for the next epoch's order
    steps_per_epoch = max(1, math.ceil(len(samples) / cfg.batch_size) // world)
    plan = {"total": cfg.max_steps or steps_per_epoch * cfg.epochs}
    plan["full"] = plan["total"]
    plan["warm"] = max(1, int(cfg.warmup_ratio * plan["total"]))

    def lr_factor(s: int) -> float:  # linear warm-up, then cosine to zero over the (possibly shortened) plan
        warm, total = plan["warm"], plan["total"]
        return (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    step, start_epoch, done_s = 0, 0, 0.0
    ckpt = out / "trainer_state.pt"
    resumed = cfg.resume and ckpt.exists()
    if resumed:
        st = torch.load(ckpt, map_location=device, weights_only=False)
        drafter.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, start_epoch = st["step"], st["epoch"]
        plan.update(st.get("plan", {}))  # a schedule the time budget shortened stays shortened
        done_s = st.get("elapsed_s", 0.0)
    gen = torch.Generator().manual_seed(cfg.seed + step + 1_000_003 * rank)  # ranks draw their own anchors
    gamma = gamma_for(cfg.block_size)
    tap_idx = [i + 1 for i in spec.target_layer_ids]
    if resumed:
        scale = st.get("tap_scale")
    else:
        scale = None
        if cfg.precondition_taps:  # measured once, on rank 0, and sent to the others
            scale = tap_scale(target, samples, tap_idx, device) if main else \
                torch.empty(drafter.fc.weight.shape[1], device=device)
            if world > 1:
                dist.broadcast(scale, 0)
        if cfg.init_drafter and scale is not None:  # the saved fc takes raw taps; training feeds taps * scale
            with torch.no_grad():
                drafter.fc.weight.div_(scale.to(drafter.fc.weight.dtype)[None, :])
    # a run that starts without saved state starts its log too (an attempt stopped before its first save left none)
    log_f = open(out / "train_log.jsonl", "a" if resumed else "w") if main else None
    t_start = time.time()
    t0 = t_start - done_s  # the time budget counts the runs before a resume too
    t_mark = (step, t_start)  # the rate marks at steps 10 and 100 replace it (a resumed run may start past them)
    bar = tqdm(total=plan["total"], initial=step, desc="training drafter", unit="step", disable=not main)
    pending: list[tuple[dict, torch.Tensor]] = []

    def flush() -> None:  # the pending records' numbers come back from the GPU in one read
        if not pending:
            return
        values = torch.stack([v for _, v in pending]).tolist()
        for (rec, _), (loss_v, tau_v, acc1_v, walk_v, sel_v, gnorm_v) in zip(pending, values):
            rec |= {"loss": loss_v, "grad_norm": gnorm_v, "tau": tau_v, "acc_slot1": acc1_v}
            if cfg.walk_floor is not None:
                rec["walk_tau"] = walk_v
            if drafter.candidate_selector is not None:
                rec["selector_loss"] = sel_v
            if main:
                log_f.write(json.dumps(rec) + "\n")
            cfg.log.append(rec)
        bar.set_postfix(loss=f"{loss_v:.3f}", tau=f"{tau_v:.2f}")
        pending.clear()

    epoch, stop = start_epoch, False
    while step < plan["total"]:
        rng = random.Random(cfg.seed * 1000 + epoch)  # anchors and order resampled every epoch
        groups = _batches(samples, cfg.batch_size, rng)[rank::world][:steps_per_epoch]
        for group in groups[step % steps_per_epoch if epoch == start_epoch else 0:]:
            ids, lengths, anchors, valid = make_batch([samples[i] for i in group], cfg.num_anchors, gen, device)
            taps, t_logits = target_features(target, ids, lengths, tap_idx, scale, cfg.labels != "data")
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                window = cfg.local_context if step < cfg.local_context_frac * plan["total"] else None
                loss, stats = dflash_loss(drafter, lm_head, embed, taps, ids, lengths, anchors, valid, mask_id, gamma,
                                          window, cfg.labels, t_logits, cfg.walk_floor, cfg.selector_loss_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            logged = torch.stack([loss.detach().float(), stats["tau"].float(), stats["acc_per_slot"][0].float(),
                                  stats.get("walk_tau", stats["tau"]).float(),
                                  stats.get("selector_loss", stats["tau"]).float()])
            average([p.grad for p in params] + [logged], world)  # the all-ranks batch's gradient
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            # the record's numbers stay on the GPU until the next flush: one wait every LOG_EVERY steps
            pending.append(({"step": step, "epoch": epoch, "lr": sched.get_last_lr()[0],
                             "elapsed_s": time.time() - t0, "total_steps": plan["total"]},
                            torch.cat([logged, gnorm.float().reshape(1)])))
            bar.update(1)
            kept = cfg.keep_every is not None and step % cfg.keep_every == 0
            due = step % LOG_EVERY == 0 or step >= plan["total"] or step % cfg.save_every == 0 or kept
            if not due:
                continue
            flush()
            if step in (10, 100):
                t_mark = (step, time.time())
            if cfg.time_budget_s and step in (30, 300):  # rate measured after warm-up, then re-measured
                rate = (step - t_mark[0]) / (time.time() - t_mark[1])
                fit = int(step + (cfg.time_budget_s - (time.time() - t0)) * rate)
                total = min(plan["full"], max(fit, step + 1))  # shrink, or grow back if it ran faster
                if world > 1:  # rank 0's clock decides for everyone
                    t = torch.tensor([total], device=device)
                    dist.broadcast(t, 0)
                    total = int(t.item())
                if total != plan["total"]:
                    plan["total"] = total
                    plan["warm"] = max(1, int(cfg.warmup_ratio * plan["total"]))
                    bar.total = plan["total"]
            stop = cfg.stop_after_s is not None and time.time() - t_called >= cfg.stop_after_s
            if world > 1 and cfg.stop_after_s is not None:  # rank 0's clock decides for everyone
                flag = torch.tensor([float(stop)], device=device)
                dist.broadcast(flag, 0)
                stop = bool(flag.item())
            if step % cfg.save_every == 0 or step == plan["total"] or stop:
                check_in_sync(params, world)
                if main:
                    torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step, "epoch": epoch,
                                "plan": dict(plan), "elapsed_s": time.time() - t0,
                                "config": asdict(cfg) | {"log": []}, "tap_scale": scale}, ckpt)
                    save_checkpoint(drafter, target_cfg, out, fc_scale=scale)
            if kept and main:
                save_checkpoint(drafter, target_cfg, out / "steps" / f"{step:06d}", fc_scale=scale)
            if step >= plan["total"] or stop:
                break
        if step >= plan["total"] or stop:
            break
        epoch += 1
    flush()
    bar.close()
    if main:
        log_f.close()
        save_checkpoint(drafter, target_cfg, out, fc_scale=scale)
    if world > 1:
        dist.barrier()  # the checkpoint exists before any rank returns
    return out


def make_data(cfg: TrainConfig, data_path: Path, device: torch.device, rank: int = 0, world: int = 1) -> None:
    """Self-distillation data into data_path. Data parallel: rank r answers every world-th prompt
    into its own part file, then rank 0 joins the parts in rank order."""
    from flashdraft import LLM
    from flashdraft.train.data import generate_responses, training_conversations

    convs = training_conversations(cfg.prompts, cfg.prompt_turns)
    if cfg.num_prompts:
        convs = convs[: cfg.num_prompts]
    llm = LLM(cfg.model, draft=None, device=str(device), max_num_seqs=cfg.gen_batch,
              max_num_batched_tokens=max(4096, cfg.gen_batch * 2))
    part = data_path if world == 1 else data_path.with_name(f"{data_path.name}.part{rank}")
    # seeds follow the global prompt index, so the data does not depend on the number of ranks
    generate_responses(llm, convs[rank::world], part, cfg.max_new_tokens, cfg.max_prompt_tokens,
                       samples_per_prompt=cfg.samples_per_prompt, temperature=cfg.gen_temperature,
                       seed=cfg.seed + rank * cfg.samples_per_prompt, seed_stride=world,
                       sampled_prefix=cfg.sampled_prefix)
    del llm
    if world > 1:
        dist.barrier()
        if rank == 0:
            parts = [data_path.with_name(f"{data_path.name}.part{r}") for r in range(world)]
            data_path.write_text("".join(p.read_text() for p in parts))
            for p in parts:
                p.unlink()
        dist.barrier()
