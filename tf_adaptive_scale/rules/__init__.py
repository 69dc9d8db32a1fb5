"""Floor 3, rules: how a scale is chosen and how gradients are clipped.

One object per scaling mode (`scale_policy`), the adaptive rule's proposal
(`adaptive_rule`), clippers (`clipping`), every optimizer argument written once
(`settings`) and the declaration of the optimizer's state (`optimizer_state`).
Pure rules of tensors; nothing here knows a model or a step.
"""
