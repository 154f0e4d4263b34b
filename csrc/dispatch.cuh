// dtype dispatch for the ridgefill kernels: float32, bfloat16 and float16
// only. AT_DISPATCH_FLOATING_TYPES_AND2 would also instantiate every kernel
// for double, which no op accepts and which costs build time.
#pragma once

#include <ATen/Dispatch.h>

#define RIDGEFILL_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)            \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                   \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)     \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                             AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))
