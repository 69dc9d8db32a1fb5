"""Loading a stock `keras.mixed_precision.LossScaleOptimizer`'s saved state.

A `.keras` file saved with the stock optimizer (same inner optimizer) holds
its variables by position: the inner optimizer's after the stock scale and
growth count. They restore into `AdaptiveLossScaleOptimizer`; a warning
names the state that starts fresh.
"""

import warnings

import keras


def load(store, inner_optimizer, trained_variables, own_state, restore_scale):
    """Loads `store` if a stock optimizer saved it.

    Args:
        store: The saved variables, by position.
        inner_optimizer: The wrapped optimizer (built).
        trained_variables: The variables the inner optimizer trains.
        own_state: The loading optimizer's own variables (its declared
            ones, a packed scalar's slot among them), by name.
        restore_scale: Whether the saved scale applies (not in a mode whose
            scale stays 1).

    Returns:
        Whether `store` was a stock optimizer's (and is loaded).
    """
    stock = keras.mixed_precision.LossScaleOptimizer(
        inner_optimizer.__class__.from_config(inner_optimizer.get_config())
    )
    stock.build(trained_variables)
    if len(store.keys()) != len(stock.variables):
        return False
    outer = len(stock.variables) - len(stock.inner_optimizer.variables)
    for variable, i in zip(inner_optimizer.variables, range(outer, len(store.keys()))):
        variable.assign(store[str(i)])
    restored = []
    for i, variable in enumerate(stock.variables[:outer]):
        name = variable.path.rsplit("/", 1)[-1]
        if name == "dynamic_scale" and not restore_scale:
            continue  # this mode's scale stays 1
        if name in own_state:
            own_state[name].assign(store[str(i)])
            restored.append(name)
    fresh = [name for name in own_state if name not in restored]
    warnings.warn(
        "Loaded the state of a stock keras LossScaleOptimizer: restored "
        f"the inner optimizer and {', '.join(restored)}; these start "
        f"fresh: {', '.join(fresh)}.",
        stacklevel=3,
    )
    return True
