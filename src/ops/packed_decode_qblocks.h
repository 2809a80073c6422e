// The packed decode kernels' walk over a tile's queries in blocks of at most 4 (the query count
// is a template constant inside each block, so its accumulators stay in registers): shared by
// the key kernels (packed_decode_vnni.cpp) and the bf16 value kernels (packed_decode_bf16.cpp).
// Meant to be included inside an anonymous namespace after the target pragmas, so that the
// blocks inline into the kernels (<cstdint> and <type_traits> included before).

// fn(std::integral_constant<int, QB>{}, m0) for the n_q queries in blocks of QB <= 4.
template <class F>
inline void for_query_blocks(int64_t n_q, F&& fn) {
  int64_t m0 = 0;
  for (; m0 + 4 <= n_q; m0 += 4) fn(std::integral_constant<int, 4>{}, m0);
  switch (n_q - m0) {
    case 3:
      fn(std::integral_constant<int, 3>{}, m0);
      break;
    case 2:
      fn(std::integral_constant<int, 2>{}, m0);
      break;
    case 1:
      fn(std::integral_constant<int, 1>{}, m0);
      break;
    default:
      break;
  }
}
