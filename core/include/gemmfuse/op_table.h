// The op table: every op of the chain IR, declared once, in OpCode order. A row is
//   X(Code, "spec name", Family, cpu_scalar)
// cpu_scalar: the CPU executor's row loops compute the op through scalar library calls (exp,
// erf, tanh and what is built on them), several times slower per element than PyTorch's
// vectorized CPU kernels (the planner routes such chains to PyTorch on the CPU).
//
// Generated from it: the OpCode enum and the spec's names (chain.h, spec.cpp), each op's
// family, the CPU and CUDA executors' pointwise dispatch, and the table the Python capture
// checks its own names against (`gemmfuse::ops`). The forward formula and the derivative of
// each Unary and Binary op are `Pointwise<OpCode::Code>` in executors/common/pointwise.h,
// one source for both executors; the dispatch instantiates it for every row, so a row without
// them fails to build. The other families' forward and backward are steps of the executors
// (row reductions, row norms, windows, column statistics). Each op's spec keys (its
// attributes) are declared in the attribute schema, attributes.h.
#pragma once

#define GEMMFUSE_UNARY_OPS(X)                  \
  X(Neg, "neg", Unary, false)                  \
  X(Abs, "abs", Unary, false)                  \
  X(Square, "square", Unary, false)            \
  X(Sqrt, "sqrt", Unary, false)                \
  X(Rsqrt, "rsqrt", Unary, false)              \
  X(Exp, "exp", Unary, true)                   \
  X(Log, "log", Unary, false)                  \
  X(Relu, "relu", Unary, false)                \
  X(Sigmoid, "sigmoid", Unary, true)           \
  X(Tanh, "tanh", Unary, true)                 \
  X(Silu, "silu", Unary, true)                 \
  X(Mish, "mish", Unary, true)                 \
  X(GeluErf, "gelu", Unary, true)              \
  X(GeluTanh, "gelu_tanh", Unary, true)        \
  X(Softplus, "softplus", Unary, true)         \
  X(Elu, "elu", Unary, true)                   \
  X(LeakyRelu, "leaky_relu", Unary, false)     \
  X(Clamp, "clamp", Unary, false)              \
  X(Pow, "pow", Unary, true)                   \
  X(Reciprocal, "reciprocal", Unary, false)

// x <op> b, or b <op> x when the node is `reversed`.
#define GEMMFUSE_BINARY_OPS(X)                 \
  X(Add, "add", Binary, false)                 \
  X(Sub, "sub", Binary, false)                 \
  X(Mul, "mul", Binary, false)                 \
  X(Div, "div", Binary, false)                 \
  X(Minimum, "minimum", Binary, false)         \
  X(Maximum, "maximum", Binary, false)

// Row reductions over the last dim (to width 1, or dropping the dim when !keepdim); their
// forward and backward are RowOp<Code> in executors/common/row_ops.h.
#define GEMMFUSE_REDUCE_OPS(X)                 \
  X(Sum, "sum", Reduce, false)                 \
  X(Mean, "mean", Reduce, false)               \
  X(Max, "max", Reduce, false)                 \
  X(Min, "min", Reduce, false)                 \
  X(LogSumExp, "logsumexp", Reduce, true)

// Row-broadcast normalisations over the last dim: the softmax-like ones (one value per
// column from the row's statistics; their forward and backward are RowOp<Code> in
// executors/common/row_ops.h), and GroupNorm (LayerNorm is GroupNorm with groups=1).
#define GEMMFUSE_SOFTMAX_OPS(X)                \
  X(Softmax, "softmax", RowNorm, true)         \
  X(LogSoftmax, "log_softmax", RowNorm, true)  \
  X(Softmin, "softmin", RowNorm, true)

#define GEMMFUSE_ROW_NORM_OPS(X)               \
  GEMMFUSE_SOFTMAX_OPS(X)                      \
  X(GroupNorm, "group_norm", RowNorm, false)

// 1-d windows over the last dim; column statistics over the rows; dropout (the identity in
// eval mode or with p = 0, refused otherwise).
#define GEMMFUSE_OTHER_OPS(X)                  \
  X(AvgPool, "avg_pool", Pool, false)          \
  X(MaxPool, "max_pool", Pool, false)          \
  X(BatchNorm, "batch_norm", ColumnNorm, false) \
  X(Dropout, "dropout", Dropout, false)

#define GEMMFUSE_OPS(X)      \
  GEMMFUSE_UNARY_OPS(X)      \
  GEMMFUSE_BINARY_OPS(X)     \
  GEMMFUSE_REDUCE_OPS(X)     \
  GEMMFUSE_ROW_NORM_OPS(X)   \
  GEMMFUSE_OTHER_OPS(X)
