"""The compile-time constants every kernel source starts with (CUDA C++ and Metal Shading Language alike)."""

import mlx.core as mx


def constant_lines(consts, types, float_literal):
    """Source lines defining a kernel's compile-time constants.

    Args:
        consts (iterable): (name, value) pairs: an mx.Dtype becomes `using NAME = TYPE;` (TYPE from `types`),
            a bool and an int `constexpr bool/int`, a float `constexpr float NAME = LITERALf;`.
        types (dict): mx.Dtype -> the language's type name.
        float_literal (callable): float -> its float32 literal text without the `f` suffix.

    Returns:
        str: one line a constant, newline-terminated.
    """
    lines = []
    for name, value in consts:
        if isinstance(value, mx.Dtype):
            lines.append(f"using {name} = {types[value]};")
        elif isinstance(value, bool):
            lines.append(f"constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, float):
            lines.append(f"constexpr float {name} = {float_literal(value)}f;")
        else:
            lines.append(f"constexpr int {name} = {int(value)};")
    return "\n".join(lines) + "\n"
