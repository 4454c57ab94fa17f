// Spec parsing and printing: every op round-trips, defaults and errors per docs/chain-spec.md;
// the attribute schema they read: every key of every op round-trips, keys outside an op's
// schema are refused, and a bare line parses to the schema's defaults.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "gemmfuse/attributes.h"
#include "gemmfuse/chain.h"

using namespace gemmfuse;

namespace {

std::string roundtrip(const std::string& spec) { return to_spec(parse_chain(spec)); }

std::vector<OpCode> all_ops() {
  std::vector<OpCode> ops;
  for (int i = 0; i <= static_cast<int>(OpCode::Dropout); ++i)
    ops.push_back(static_cast<OpCode>(i));
  return ops;
}

// Every field of a Node, for comparing whole nodes.
auto fields(const Node& n) {
  return std::make_tuple(n.op, n.b, n.reversed, n.lo, n.hi, n.alpha, n.beta, n.threshold, n.eps,
                         n.momentum, n.p, n.groups, n.kernel, n.stride, n.padding, n.keepdim,
                         n.first_index, n.ceil_mode, n.count_include_pad, n.training,
                         n.track_running_stats, n.weight, n.bias, n.running_mean, n.running_var,
                         n.num_batches);
}

// The single stage of a spec whose stage line is `line`.
Node parse_stage(const std::string& line) {
  const Chain c = parse_chain("linear in=4 out=8 bias=1\n" + line + "\n");
  if (c.nodes.size() != 1) throw std::logic_error("one stage expected");
  return c.nodes[0];
}

// `op` with its required keys, each at a valid value of its type.
std::string line_with_required_keys(OpCode op) {
  std::string line = op_name(op);
  for (const Attribute& a : attributes(op))
    if (a.missing_error)
      line += std::string(" ") + a.key + "=" + (a.type == AttrType::Bool ? "1" : "2");
  return line;
}

// Sets key `a` of `n` to a value other than its default; `round` picks among several.
void set_other_value(Node& n, const Attribute& a, int round) {
  const double numbers[] = {0.375, -2.5, 1e-7, 7.0};
  const double numbers_or_none[] = {-1.0, 0.375, 0.0, 7.0};  // -1: none
  const Operand operands[] = {Operand::tensor(1), Operand::state(2), Operand::immediate(-0.5),
                              Operand::value(0)};  // v0: the stage's input
  switch (a.type) {
    case AttrType::Number: n.*a.number = numbers[round]; break;
    case AttrType::NumberOrNone: n.*a.number = numbers_or_none[round]; break;
    case AttrType::Integer:
      n.*a.integer = (a.default_from ? n.*a.default_from : int64_t(a.default_value)) + 1 + round;
      break;
    case AttrType::Bool: n.*a.boolean = a.default_value == 0.0; break;
    case AttrType::Operand: n.*a.operand = operands[round]; break;
  }
  if (has_default_value(n, a)) set_other_value(n, a, (round + 1) % 4);
}

}  // namespace

TEST(Spec, EveryOpRoundTrips) {
  const std::string lines[] = {
      "neg", "abs", "square", "sqrt", "rsqrt", "exp", "log", "relu", "sigmoid", "tanh", "silu",
      "mish", "gelu", "gelu_tanh", "softplus beta=2 threshold=10", "elu alpha=0.5",
      "leaky_relu alpha=0.20000000000000001", "clamp lo=-10 hi=10", "clamp lo=0", "clamp hi=6",
      "pow alpha=3", "reciprocal", "add b=2.5", "sub b=t0 rev=1", "mul b=v1", "div b=-inf",
      "minimum b=nan", "maximum b=t1", "sum", "mean keepdim=0", "max", "min", "logsumexp",
      "softmax", "log_softmax", "softmin", "group_norm groups=4 eps=0.001 weight=t0 bias=t1",
      "avg_pool kernel=3 stride=2 padding=1 ceil=1 include_pad=0", "max_pool kernel=2",
      "batch_norm training=1 momentum=none weight=t0 bias=t1 running_mean=s0 running_var=s1 "
      "num_batches=s2",
      "batch_norm training=0 eps=0.001 momentum=0.5", "dropout p=0.5 training=0",
  };
  for (const std::string& l : lines) {
    const std::string spec = "linear in=8 out=16 bias=1\nexp\n" + l + "\n";
    SCOPED_TRACE(l);
    const Chain c = parse_chain(spec);
    ASSERT_EQ(c.nodes.size(), 2u);
    EXPECT_EQ(to_spec_line(c.nodes[1]), l);
    EXPECT_EQ(roundtrip(spec), spec);
    OpCode op;
    ASSERT_TRUE(op_from_name(l.substr(0, l.find(' ')), &op));
    EXPECT_EQ(op, c.nodes[1].op);
    EXPECT_STREQ(op_name(op), l.substr(0, l.find(' ')).c_str());
  }
}

TEST(Spec, AllOpNamesAreDistinctAndFamilies) {
  for (int i = 0; i <= static_cast<int>(OpCode::Dropout); ++i) {
    const OpCode op = static_cast<OpCode>(i);
    OpCode back;
    ASSERT_TRUE(op_from_name(op_name(op), &back)) << i;
    EXPECT_EQ(back, op);
  }
  EXPECT_EQ(family(OpCode::Mish), OpFamily::Unary);
  EXPECT_EQ(family(OpCode::Maximum), OpFamily::Binary);
  EXPECT_EQ(family(OpCode::LogSumExp), OpFamily::Reduce);
  EXPECT_EQ(family(OpCode::GroupNorm), OpFamily::RowNorm);
  EXPECT_EQ(family(OpCode::MaxPool), OpFamily::Pool);
  EXPECT_EQ(family(OpCode::BatchNorm), OpFamily::ColumnNorm);
  EXPECT_EQ(family(OpCode::Dropout), OpFamily::Dropout);
  EXPECT_FALSE(op_from_name("linear", nullptr));
}

TEST(Spec, DefaultsAndValues) {
  const Chain c = parse_chain(
      "linear in=3 out=5 bias=0\n"
      "leaky_relu\nsoftplus\nclamp\ndropout\navg_pool kernel=2\nbatch_norm\n"
      "mul b=0.1\nadd b=-1e-05\nsub b=inf\ndiv b=-inf\nmaximum b=nan\nbatch_norm momentum=none\n"
      "  \n");
  EXPECT_EQ(c.in_features, 3);
  EXPECT_EQ(c.out_features, 5);
  EXPECT_FALSE(c.has_bias);
  ASSERT_EQ(c.nodes.size(), 12u);
  EXPECT_DOUBLE_EQ(c.nodes[0].alpha, 0.01);
  EXPECT_EQ(c.nodes[1].beta, 1.0);
  EXPECT_EQ(c.nodes[1].threshold, 20.0);
  EXPECT_TRUE(std::isinf(c.nodes[2].lo) && c.nodes[2].lo < 0);
  EXPECT_TRUE(std::isinf(c.nodes[2].hi) && c.nodes[2].hi > 0);
  EXPECT_EQ(c.nodes[3].p, 0.5);
  EXPECT_FALSE(c.nodes[3].training);
  EXPECT_EQ(c.nodes[4].stride, 2);
  EXPECT_EQ(c.nodes[4].padding, 0);
  EXPECT_TRUE(c.nodes[4].count_include_pad);
  EXPECT_FALSE(c.nodes[5].training);
  EXPECT_EQ(c.nodes[5].eps, 1e-5);
  EXPECT_EQ(c.nodes[5].momentum, 0.1);
  EXPECT_FALSE(c.nodes[5].track_running_stats);
  EXPECT_EQ(c.nodes[6].b.kind, Operand::Kind::Imm);
  EXPECT_EQ(c.nodes[6].b.imm, 0.1);
  EXPECT_EQ(c.nodes[7].b.imm, -1e-5);
  EXPECT_TRUE(std::isinf(c.nodes[8].b.imm) && c.nodes[8].b.imm > 0);
  EXPECT_TRUE(std::isinf(c.nodes[9].b.imm) && c.nodes[9].b.imm < 0);
  EXPECT_TRUE(std::isnan(c.nodes[10].b.imm));
  EXPECT_LT(c.nodes[11].momentum, 0);
  // %.17g keeps every double exactly.
  EXPECT_EQ(to_spec_line(c.nodes[6]), "mul b=0.10000000000000001");
  EXPECT_EQ(parse_chain(to_spec(c)).nodes[6].b.imm, 0.1);
  EXPECT_EQ(to_spec_line(c.nodes[10]), "maximum b=nan");
  EXPECT_EQ(to_spec_line(c.nodes[11]), "batch_norm training=0 momentum=none");
}

TEST(Spec, KeysInAnyOrder) {
  const Chain a = parse_chain("linear bias=1 out=4 in=2\nclamp hi=1 lo=-1\n");
  EXPECT_EQ(a.in_features, 2);
  EXPECT_EQ(to_spec(a), "linear in=2 out=4 bias=1\nclamp lo=-1 hi=1\n");
}

TEST(Spec, SemicolonsSeparateLines) {
  const std::string lines = "linear in=2 out=4 bias=1\nclamp lo=-1 hi=1\nadd b=v1\n";
  EXPECT_EQ(to_spec(parse_chain("linear in=2 out=4 bias=1; clamp lo=-1 hi=1; add b=v1")),
            to_spec(parse_chain(lines)));
}

TEST(Spec, ErrorsNameTheLine) {
  auto msg = [](const std::string& spec) -> std::string {
    try {
      parse_chain(spec);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(msg("linear in=2 out=3 bias=1\nfrobnicate\n").find("line 2"), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3 bias=1\nfrobnicate\n").find("unknown op 'frobnicate'"),
            std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\nrelu\nmul c=2\n").find("line 3"), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\nrelu\nmul c=2\n").find("unknown key 'c'"), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\nmul\n").find("needs b="), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\nmul b=x\n").find("not a number"), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\nmul b=v2\n").find("not an earlier value"), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\nsum keepdim=2\n").find("not 0 or 1"), std::string::npos);
  EXPECT_NE(msg("relu\n").find("line 1"), std::string::npos);
  EXPECT_NE(msg("linear in=2\n").find("needs in= and out="), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\nmax_pool stride=2\n").find("kernel="), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\npow\n").find("alpha="), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\nclamp lo=1 lo=2\n").find("twice"), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\nexp alpha=2\n").find("unknown key"), std::string::npos);
  EXPECT_NE(msg("").find("empty"), std::string::npos);
  EXPECT_NE(msg("linear in=2 out=3\nlinear in=3 out=3\n").find("line 2"), std::string::npos);
}

TEST(Spec, WidthsAndFeatureDim) {
  const Chain c = parse_chain(
      "linear in=4 out=10 bias=1\n"
      "avg_pool kernel=3 stride=2 padding=1 ceil=1\n"  // v1
      "max_pool kernel=2 stride=2\n"                   // v2
      "sum\n"                                          // v3: width 1
      "mean keepdim=0\n"                               // v4: no feature dim
      "exp\n");                                        // v5
  EXPECT_EQ(c.width_of(0), 10);
  // PyTorch: L=10, k=3, s=2, p=1, ceil: ceil((10+2-3)/2)+1 = 6; (6-1)*2=10 >= 10+1? no -> 6.
  EXPECT_EQ(c.width_of(1), 6);
  EXPECT_EQ(c.width_of(2), 3);
  EXPECT_EQ(c.width_of(3), 1);
  EXPECT_TRUE(c.has_feature_dim(3));
  EXPECT_EQ(c.width_of(4), 0);
  EXPECT_FALSE(c.has_feature_dim(4));
  EXPECT_FALSE(c.output_has_feature_dim());
  EXPECT_EQ(c.output_width(), 0);
  EXPECT_THROW(c.width_of(7), std::out_of_range);
}

TEST(Spec, PoolOutputWidthMatchesPyTorch) {
  // Values from torch.nn.functional.avg_pool1d(torch.zeros(1, 1, L), k, s, p, ceil_mode).shape
  struct Case { int64_t L, k, s, p; bool ceil; int64_t out; };
  const Case cases[] = {
      {10, 3, 2, 1, true, 6}, {10, 3, 2, 1, false, 5}, {5, 2, 2, 0, true, 3},
      {5, 2, 2, 0, false, 2}, {4, 2, 2, 1, true, 3},   {7, 3, 3, 1, true, 3},
      {8, 4, 3, 2, true, 4},  {1, 1, 1, 0, false, 1},  {6, 3, 2, 0, true, 3},
  };
  for (const Case& k : cases) {
    Node n;
    n.op = OpCode::AvgPool;
    n.kernel = k.k;
    n.stride = k.s;
    n.padding = k.p;
    n.ceil_mode = k.ceil;
    EXPECT_EQ(pool_output_width(k.L, n), k.out) << k.L << " " << k.k << " " << k.s << " " << k.p;
  }
}

TEST(SpecSchema, IsWellFormed) {
  for (OpCode op : all_ops()) {
    SCOPED_TRACE(op_name(op));
    std::set<std::string> keys;
    for (const Attribute& a : attributes(op)) {
      EXPECT_TRUE(keys.insert(a.key).second) << "key " << a.key << " twice";
      const int members = (a.number != nullptr) + (a.integer != nullptr) +
                          (a.boolean != nullptr) + (a.operand != nullptr);
      EXPECT_EQ(members, 1) << a.key;
      if (a.missing_error) EXPECT_EQ(a.print, AttrPrint::Always) << a.key;
      if (a.default_from) {  // an earlier Integer key, so its value is final first
        EXPECT_EQ(a.type, AttrType::Integer) << a.key;
        bool earlier = false;
        for (const Attribute& b : attributes(op)) {
          if (&b == &a) break;
          earlier |= b.integer == a.default_from;
        }
        EXPECT_TRUE(earlier) << a.key;
      }
    }
  }
}

// Every key of every op set to a value other than its default prints, and reads back as the
// same node.
TEST(SpecSchema, EveryKeyOfEveryOpRoundTrips) {
  for (OpCode op : all_ops()) {
    for (int round = 0; round < 4; ++round) {
      Node n = default_node(op);
      for (const Attribute& a : attributes(op)) set_other_value(n, a, round);
      derive_unkeyed_fields(n);
      const std::string line = to_spec_line(n);
      SCOPED_TRACE(line);
      for (const Attribute& a : attributes(op)) {
        EXPECT_FALSE(has_default_value(n, a)) << a.key;
        EXPECT_NE(line.find(std::string(" ") + a.key + "="), std::string::npos) << a.key;
      }
      const Node back = parse_stage(line);
      EXPECT_TRUE(fields(back) == fields(n)) << "read back as " << to_spec_line(back);
      EXPECT_EQ(to_spec_line(back), line);
    }
  }
}

TEST(SpecSchema, EveryOpRejectsKeysOutsideItsSchema) {
  std::set<std::string> every_key = {"frobnicate", "in", "out"};
  for (OpCode op : all_ops())
    for (const Attribute& a : attributes(op)) every_key.insert(a.key);
  for (OpCode op : all_ops()) {
    for (const std::string& key : every_key) {
      if (find_attribute(op, key)) continue;
      const std::string line = line_with_required_keys(op) + " " + key + "=1";
      SCOPED_TRACE(line);
      try {
        parse_stage(line);
        ADD_FAILURE() << "accepted";
      } catch (const std::invalid_argument& e) {
        const std::string want = "unknown key '" + key + "' for " + op_name(op);
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
    }
  }
}

// A line naming only the op (and its required keys) parses to the schema's defaults.
TEST(SpecSchema, DefaultsAreWhatABareLineParsesTo) {
  for (OpCode op : all_ops()) {
    const std::string line = line_with_required_keys(op);
    SCOPED_TRACE(line);
    const Node n = parse_stage(line);
    bool any_required = false;
    for (const Attribute& a : attributes(op)) {
      if (a.missing_error) {
        any_required = true;
        EXPECT_FALSE(has_default_value(n, a)) << a.key;  // the line's value, not the default
      } else {
        EXPECT_TRUE(has_default_value(n, a)) << a.key;
      }
    }
    if (!any_required) EXPECT_TRUE(fields(n) == fields(default_node(op)));
  }
  // The op-specific defaults of docs/chain-spec.md.
  EXPECT_EQ(default_node(OpCode::LeakyRelu).alpha, 0.01);
  EXPECT_EQ(default_node(OpCode::Elu).alpha, 1.0);
  EXPECT_EQ(default_node(OpCode::Dropout).p, 0.5);
  EXPECT_EQ(parse_stage("max_pool kernel=3").stride, 3);
  EXPECT_FALSE(default_node(OpCode::BatchNorm).track_running_stats);
  EXPECT_TRUE(parse_stage("batch_norm running_mean=s0").track_running_stats);
}

TEST(SpecSchema, RequiredKeysAndBadValuesKeepTheirMessages) {
  auto msg = [](const std::string& line) -> std::string {
    try {
      parse_stage(line);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(msg("sub rev=1").find("binary op needs b="), std::string::npos);
  EXPECT_NE(msg("pow").find("pow needs alpha= (the exponent)"), std::string::npos);
  EXPECT_NE(msg("avg_pool stride=2").find("pooling needs kernel="), std::string::npos);
  EXPECT_NE(msg("max_pool kernel=2 include_pad=0").find("unknown key 'include_pad' for max_pool"),
            std::string::npos);
  EXPECT_NE(msg("sum index=1").find("unknown key 'index' for sum"), std::string::npos);
  EXPECT_NE(msg("batch_norm momentum=-1").find("momentum must be >= 0 or none"),
            std::string::npos);
  EXPECT_NE(msg("group_norm groups=x").find("'x' is not an integer"), std::string::npos);
  // A bad value fails before a missing required key is noticed.
  EXPECT_NE(msg("add rev=2").find("not 0 or 1"), std::string::npos);
}
