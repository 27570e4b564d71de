"""Views, reshapes and permutations that keep every token's column of the logits whole.

The post-op chain goes on through them (``logits[:, -1]``, ``.view(-1, V)``, a transpose): the compact logits take
the same view, and a mask carried through them stays on the vocabulary axis (:func:`vocab_axis_after` says where
that axis lands). Anything that cuts or mixes columns is no such view.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .graph import node_name
from .patterns import is_call, known_equal, tensor_shape

# ---------------------------------------------------------------------------- column-keeping views
# Views and reshapes that keep every token's column whole: the vocabulary axis survives as one axis
# of the result (maybe at another position), in order. Elementwise steps after them are still steps
# of the logits chain; anything else reading them ends the chain.
RESHAPE_METHODS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous", "detach",
                   "expand", "expand_as", "view_as", "reshape_as"}
RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze, torch.detach}
PERMUTE_METHODS = {"transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t"}
PERMUTE_FUNCTIONS = {torch.transpose, torch.swapaxes, torch.swapdims, torch.permute, torch.movedim, torch.moveaxis,
                     torch.t}


def _last_dim(shape: tuple | None) -> Any:
    return shape[-1] if shape else None


def view_keeps_vocab(node: fx.Node, logits: fx.Node, vocab_size: int) -> bool:
    """Whether ``node`` is a view of ``logits`` that leaves the last (vocabulary) axis whole."""
    shape = tensor_shape(logits)
    if shape is None or node.args[0] is not logits:
        return False
    ndim = len(shape)
    if node.op == "call_function" and node.target is operator.getitem:
        idx = node.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(i is Ellipsis or i is None or isinstance(i, fx.Node) and tensor_shape(i) is not None for i in idx):
            return False
        if not all(isinstance(i, (int, slice, fx.Node)) for i in idx):
            return False
        return len(idx) < ndim or (len(idx) == ndim and idx[-1] == slice(None))
    if node.op == "call_method" and node.target in ("view", "reshape"):
        dims = node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        return (len(dims) > 0 and dims[-1] == vocab_size and tensor_shape(node) is not None
                and _last_dim(tensor_shape(node)) == vocab_size)
    if node.op == "call_method" and node.target in ("squeeze", "unsqueeze") and len(node.args) == 2:
        d = node.args[1]
        return isinstance(d, int) and 0 <= d < ndim - (node.target == "squeeze")
    return False


def is_basic_indexing(node: fx.Node, logits: fx.Node) -> bool:
    """``logits[...]`` with ints, slices, ``...`` and ``None`` only (a view, any axis)."""
    if not (node.op == "call_function" and node.target is operator.getitem and node.args[0] is logits):
        return False
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return all(i is Ellipsis or i is None or isinstance(i, (int, slice)) or
               (isinstance(i, fx.Node) and tensor_shape(i) is None) for i in idx)


def reads_row_size(node: fx.Node, logits: fx.Node) -> bool:
    """``logits.size(d)`` / ``sym_size(logits, d)`` for a non-vocabulary dim d (same in compact space)."""
    shape = tensor_shape(logits)
    if shape is None:
        return False
    is_size = (node.op == "call_method" and node.target == "size") or (
        node.op == "call_function" and node.target is torch.ops.aten.sym_size.int
    )
    if not is_size or len(node.args) < 2 or not isinstance(node.args[1], int):
        return False
    d = node.args[1] % len(shape)
    return d != len(shape) - 1


def _product(dims) -> Any:
    out = 1
    for d in dims:
        out = out * d
    return out


def _ints(args) -> list | None:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    return list(args) if all(isinstance(a, int) for a in args) else None


def _permutation(node: fx.Node, ndim: int) -> list[int] | None:
    """``perm`` with ``out axis i = in axis perm[i]`` when ``node`` only permutes axes, else None."""
    name = node_name(node, attribute=True)
    args = node.args[1:]
    if node.op == "call_function" and node.target is getattr:
        attr = node.args[1]
        if attr in ("T", "H"):
            return list(reversed(range(ndim)))
        if attr in ("mT", "mH") and ndim >= 2:
            return list(range(ndim - 2)) + [ndim - 1, ndim - 2]
        return None
    if name in ("numpy_T",):
        return list(reversed(range(ndim)))
    if name in ("mT", "mH", "adjoint") and ndim >= 2:
        return list(range(ndim - 2)) + [ndim - 1, ndim - 2]
    if not is_call(node, PERMUTE_FUNCTIONS, PERMUTE_METHODS):
        return None
    if name == "t":
        return list(reversed(range(ndim))) if ndim <= 2 else None
    if name in ("transpose", "swapaxes", "swapdims"):
        dims = _ints(args[:2])
        if dims is None or len(dims) != 2:
            return None
        a, b = (d % ndim for d in dims)
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if name == "permute":
        dims = _ints(args)
        return [d % ndim for d in dims] if dims is not None and len(dims) == ndim else None
    if name in ("movedim", "moveaxis") and len(args) == 2:
        src, dst = ([a] if isinstance(a, int) else list(a) if isinstance(a, (tuple, list)) else None for a in args)
        if src is None or dst is None or len(src) != len(dst):
            return None
        src, dst = [s % ndim for s in src], [d % ndim for d in dst]
        perm: list = [None] * ndim
        for s, d in zip(src, dst):
            perm[d] = s
        rest = iter(i for i in range(ndim) if i not in src)
        return [p if p is not None else next(rest) for p in perm]
    return None


def _index_axis(index: Any, in_shape: tuple, axis: int) -> int | None:
    """Where basic indexing ``x[index]`` puts ``x``'s axis ``axis`` (None: it is selected or cut)."""
    idx = index if isinstance(index, tuple) else (index,)
    if not all(i is Ellipsis or i is None or isinstance(i, (int, slice)) or
               (isinstance(i, fx.Node) and tensor_shape(i) is None) for i in idx):
        return None  # a tensor index: advanced indexing copies and reorders
    consumed = sum(1 for i in idx if i is not None and i is not Ellipsis)
    in_dim = out_dim = 0
    for i in idx:
        if i is None:
            out_dim += 1
        elif i is Ellipsis:
            n = len(in_shape) - consumed
            if in_dim <= axis < in_dim + n:
                return out_dim + axis - in_dim
            in_dim, out_dim = in_dim + n, out_dim + n
        elif isinstance(i, slice):
            if in_dim == axis:
                return out_dim if i == slice(None) else None
            in_dim, out_dim = in_dim + 1, out_dim + 1
        else:  # an int (or a SymInt): selects one entry of this axis
            if in_dim == axis:
                return None
            in_dim += 1
    return out_dim + axis - in_dim if axis >= in_dim else None


def vocab_axis_after(node: fx.Node, src: fx.Node, axis: int) -> int | None:
    """The axis of ``node`` that holds axis ``axis`` of ``src`` whole and in order, when ``node`` is a
    view, reshape or permutation of ``src`` (its first argument) that keeps each column of that axis."""
    in_shape, out_shape = tensor_shape(src), tensor_shape(node)
    if in_shape is None or out_shape is None or not node.args or node.args[0] is not src or not in_shape:
        return None
    axis %= len(in_shape)
    if node.op == "call_function" and node.target is operator.getitem:
        return _index_axis(node.args[1], in_shape, axis)
    perm = _permutation(node, len(in_shape))
    if perm is not None:
        return perm.index(axis) if sorted(perm) == list(range(len(in_shape))) else None
    if node.op == "call_function" and node.target is getattr and node.args[1] == "data":
        return axis
    if not is_call(node, RESHAPE_FUNCTIONS, RESHAPE_METHODS):
        return None
    if node_name(node, attribute=True) in ("expand", "expand_as"):
        shift = len(out_shape) - len(in_shape)
        return axis + shift if shift >= 0 and known_equal(out_shape[axis + shift], in_shape[axis]) else None
    prefix = _product(in_shape[:axis])
    for k, d in enumerate(out_shape):
        if known_equal(d, in_shape[axis]) and known_equal(_product(out_shape[:k]), prefix):
            return k
    return None


def is_reshape_or_permute(node: fx.Node) -> bool:
    """A view, reshape or permutation of its first argument (``x.T``/``x.mT`` included)."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("T", "mT", "H", "mH")
    return is_call(node, RESHAPE_FUNCTIONS | PERMUTE_FUNCTIONS, RESHAPE_METHODS | PERMUTE_METHODS) or \
        node_name(node, attribute=True) in ("numpy_T", "mT", "mH", "adjoint")
