// The attribute schema: every key=value an op's spec line takes (docs/chain-spec.md), declared
// once in core/src/attributes.cpp. An op's keys are its family's followed by its own, in the
// order the spec prints them. The spec's parser and printer (spec.cpp) are loops over it: each
// key's type, the Node member it sets, its default, whether the line must give it and when it
// is printed all come from here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gemmfuse/chain.h"

namespace gemmfuse {

// How a key's value is spelled.
enum class AttrType : uint8_t {
  Number,        // a double: `2.5`, `-1e-05`, `inf`, `nan`
  Integer,       // an int64
  Bool,          // 0 or 1
  Operand,       // a number, t<i>, s<i> or v<i>
  NumberOrNone,  // a number >= 0, or `none` (stored as -1)
};

// When the printer writes a key.
enum class AttrPrint : uint8_t {
  UnlessDefault,  // only when the value differs from the default (an Operand: when present)
  Always,
};

struct Attribute {
  const char* key;  // the spec's name
  AttrType type;
  // The Node member the key sets: the one of `type`'s kind; the others are null.
  double Node::*number = nullptr;    // Number, NumberOrNone
  int64_t Node::*integer = nullptr;  // Integer
  bool Node::*boolean = nullptr;     // Bool
  Operand Node::*operand = nullptr;  // Operand
  // The value a line without the key gets: `default_value` (an Integer's, or 0/1 for a Bool,
  // held exactly), or the value of `default_from`, an Integer key listed earlier (pooling's
  // stride is its kernel). An Operand's default is absent.
  double default_value = 0.0;
  int64_t Node::*default_from = nullptr;
  AttrPrint print = AttrPrint::UnlessDefault;
  const char* missing_error = nullptr;  // a required key: the error when a line leaves it out

  // A required key, printed always (the line must give it back).
  constexpr Attribute required(const char* why) const {
    Attribute a = *this;
    a.missing_error = why;
    a.print = AttrPrint::Always;
    return a;
  }
  constexpr Attribute printed_always() const {
    Attribute a = *this;
    a.print = AttrPrint::Always;
    return a;
  }
  // An Integer key whose default is the value of an earlier Integer key.
  constexpr Attribute defaults_to(int64_t Node::*member) const {
    Attribute a = *this;
    a.default_from = member;
    return a;
  }
};

// The keys of op `op`: its family's, then its own, in the order the spec prints them.
const std::vector<Attribute>& attributes(OpCode op);
// The key `key` of op `op`, or null when the op takes no such key.
const Attribute* find_attribute(OpCode op, const std::string& key);

// Whether node `n` holds key `a`'s default (NaN equals NaN; an Operand: absent).
bool has_default_value(const Node& n, const Attribute& a);
// Sets key `a` of node `n` to its default (a `default_from` must be set already).
void set_default_value(Node& n, const Attribute& a);
// Sets the fields no key names from those that keys set, once a node's keys are final:
// BatchNorm tracks running statistics when it has running_mean.
void derive_unkeyed_fields(Node& n);
// A node of op `op` with every key at its default (a required key too, which a line must give)
// and its derived fields set: what a line naming only the op parses to.
Node default_node(OpCode op);

}  // namespace gemmfuse
