"""Where each merge method comes from: its name as its authors write it and the paper (or page)
that defines it, as mergekit 0.1.5 credits them. Read by the model card and ``mergefs methods``.
Pure data; any thread.
"""

from __future__ import annotations

#: method -> (name as published, reference URL or None)
PAPERS: dict[str, tuple[str, str | None]] = {
    "linear": ("Linear", "https://arxiv.org/abs/2203.05482"),
    "task_arithmetic": ("Task Arithmetic", "https://arxiv.org/abs/2212.04089"),
    "ties": ("TIES", "https://arxiv.org/abs/2306.01708"),
    "dare_ties": ("DARE TIES", "https://arxiv.org/abs/2311.03099"),
    "dare_linear": ("Linear DARE", "https://arxiv.org/abs/2311.03099"),
    "breadcrumbs": ("Model Breadcrumbs", "https://arxiv.org/abs/2312.06795"),
    "breadcrumbs_ties": ("Model Breadcrumbs with TIES", "https://arxiv.org/abs/2312.06795"),
    "della": ("DELLA", "https://arxiv.org/abs/2406.11617"),
    "della_linear": ("Linear DELLA", "https://arxiv.org/abs/2406.11617"),
    "slerp": ("SLERP", "https://en.wikipedia.org/wiki/Slerp"),
    "nuslerp": ("NuSLERP", None),
    "multislerp": ("Multi-SLERP", "https://goddard.blog/posts/multislerp-wow-what-a-cool-idea"),
    "karcher": ("Karcher Mean", "https://arxiv.org/abs/2603.04972"),
    "model_stock": ("Model Stock", "https://arxiv.org/abs/2403.19522"),
    "sce": ("SCE", "https://arxiv.org/abs/2408.07990"),
    "nearswap": ("NearSwap", "https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001"),
    "passthrough": ("Passthrough", None),
    "arcee_fusion": ("Arcee Fusion", "https://arcee.ai"),
    "ram": ("Reinforced Agent Merging", "https://arxiv.org/abs/2601.13572"),
    "ramplus_tl": ("Reinforced Agent Merging Plus (Tensor-Local)",
                   "https://arxiv.org/abs/2601.13572"),
    "magmax": ("MagMax", "https://arxiv.org/abs/2407.06322"),
    "consensus_ta": ("Consensus Task Arithmetic", "https://arxiv.org/abs/2405.07813"),
    "consensus_ties": ("Consensus TIES", "https://arxiv.org/abs/2405.07813"),
    "tsv_m": ("TSV-M (Task Singular Vectors)", "https://arxiv.org/abs/2412.00081"),
    "iso_c": ("Iso-C (isotropic merging, common subspace)", "https://arxiv.org/abs/2502.04959"),
    "iso_cts": ("Iso-CTS (isotropic merging, common and task-specific subspaces)",
                "https://arxiv.org/abs/2502.04959"),
}


def reference_md(method: str) -> str:
    """The method as a Markdown link to its paper (its bare name when there is none)."""
    name, url = PAPERS.get(method, (method, None))
    return f"[{name}]({url})" if url else name
