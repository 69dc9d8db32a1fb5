"""The private Keras APIs this package reads, each where no public one serves.

Kept in one place so that a Keras upgrade that moves them breaks here.
"""


def own_loss_ids(layer):
    """The ids of the losses `layer` and its sublayers added in their last
    call (`add_loss`, activity regularisers), weight regularisers excepted.

    `Layer.losses` mixes these with regularisation losses made afresh on
    each read and says nothing of who added what; an instrumented model
    needs the owner to give each loss its unit's scale. Eagerly and on
    TensorFlow a layer keeps its losses in `_losses`; inside a JAX stateless
    scope, their ids in `_loss_ids`.
    """
    ids = set()
    for sublayer in layer._flatten_layers(include_self=True):
        ids.update(sublayer._loss_ids)
        ids.update(id(loss) for loss in sublayer._losses)
    return ids


def collected_losses(model):
    """The losses a JAX `stateless_call(..., return_losses=True)` collected
    and the trainer set on `model` for `compute_loss` (empty elsewhere):
    they went through `model.losses` once already."""
    return model._losses_override
