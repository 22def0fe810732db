"""flashdraft's Triton kernels and their thin launchers; models/ calls them for what differs per family.
Every module but dispatch.py and int4_layout.py needs triton to import (this package itself imports without it):

    dispatch          whether a forward takes the kernels (settings.FUSED, settings.GEMM), with no triton
    launch            programmatic dependent launch (PDL), arrival counts, the device's SM count
    attention         paged attention over the KV cache, and the K/V store
    attention_splits  attention's split-K partitions: how many, their workspace, the merge of their partials
    skinny_gemm       few-row GEMMs (decode, verify and draft blocks), split-K and the silu * up epilogue
    fp8_gemm          few-row GEMMs of block-scaled FP8 weights and bf16 activations (W8A16)
    int4_gemm         few-row GEMMs of 4-bit weights (AWQ, GPTQ, pack-quantized; int4_layout.py packs them) and
                      bf16 activations (W4A16)
    layer_ops         a decoder layer's elementwise work: add + RMSNorm, q/k norm + RoPE + K/V store, silu * up
    token_ops         a step's token work: embedding, argmax, top-k, DFlash acceptance, graphed block slots
    gdn_ops           Gated DeltaNet layers: the causal conv, the recurrence, the gated norm
    moe_experts       mixture-of-experts MLPs: the routed rows sorted by expert, two grouped GEMMs
    moe_routing       mixture-of-experts routing: top-k, and the router fused with the norm before it
    tree_ops          token trees: build, accept, move their K/V, the graphed tree verify's inputs"""
