// How the CUDA launchers (ops_cuda.cu) walk the rows of their inputs without copying any of them. Plain C++,
// no torch and no CUDA, so that it also compiles on its own (tests/test_cuda_ops_simt.py checks it on layouts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kl_cuda {

// The rows of an op's inputs: all of one leading shape `lead` (the dims before the last), each input with its
// own strides of those dims. The innermost leading dims that every input walks with one row stride (size-1 dims
// are never stepped, so their strides do not matter) are one launch's `rows`; the leading dims outside that run
// are walked on the host, one launch per index, outermost first. Launch l covers rows [l * rows, (l + 1) * rows)
// of the row-major order, which is also where those rows are in a contiguous output. Contiguous tensors, row
// slices, padded, expanded and transposed rows take one launch; a slice or a permutation of a batch of matrices
// can take several (rare).
class RowPlan {
 public:
  RowPlan(const std::vector<int64_t>& lead, const std::vector<std::vector<int64_t>>& strides)
      : row_stride(strides.size(), 0), strides_(strides) {
    const size_t n = strides_.size();
    std::vector<size_t> dims;  // the dims that are stepped
    for (size_t d = 0; d < lead.size(); ++d)
      if (lead[d] != 1) dims.push_back(d);
    if (dims.empty()) return;  // one row
    size_t inner = dims.size() - 1;  // the run is dims[inner..]
    std::vector<int64_t> next(n);    // per input, the stride the next outer dim needs to join the run
    rows = lead[dims[inner]];
    for (size_t k = 0; k < n; ++k) {
      row_stride[k] = strides_[k][dims[inner]];
      next[k] = row_stride[k] * lead[dims[inner]];
    }
    while (inner > 0) {
      const size_t d = dims[inner - 1];
      bool joins = true;
      for (size_t k = 0; k < n; ++k) joins = joins && strides_[k][d] == next[k];
      if (!joins) break;
      rows *= lead[d];
      for (size_t k = 0; k < n; ++k) next[k] = strides_[k][d] * lead[d];
      --inner;
    }
    outer_.assign(dims.begin(), dims.begin() + inner);
    for (const size_t d : outer_) {
      sizes_.push_back(lead[d]);
      launches *= lead[d];
    }
  }

  // The element offset of launch `launch`'s first row in input `input`.
  int64_t offset(size_t input, int64_t launch) const {
    int64_t off = 0;
    for (size_t j = outer_.size(); j-- > 0;) {
      off += (launch % sizes_[j]) * strides_[input][outer_[j]];
      launch /= sizes_[j];
    }
    return off;
  }

  int64_t rows = 1;                 // rows of one launch
  int64_t launches = 1;             // launches over all the rows
  std::vector<int64_t> row_stride;  // per input: the distance between neighbouring rows of a launch

 private:
  std::vector<std::vector<int64_t>> strides_;
  std::vector<size_t> outer_;   // the host-walked dims, outermost first
  std::vector<int64_t> sizes_;  // and their sizes
};

}  // namespace kl_cuda
