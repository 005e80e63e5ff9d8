// Runs one kernel of kernels/moe.cu on the CPU (through cuda_on_cpu.h) on numbers read from
// standard input, and prints what it wrote. Driven by tests/kernels_on_cpu.rs, which builds
// this with the kernel sources as "kernels.inc" (moe.cu) and "dense.inc" (dense.cu).

#include "cuda_on_cpu.h"
#include "kernels.inc"
#include "dense.inc"

#include <cstdio>
#include <iostream>
#include <string>

template <class T>
std::vector<T> read(size_t n) {
    std::vector<T> v(n);
    for (auto& x : v) std::cin >> x;
    return v;
}

template <class T>
void print(const std::vector<T>& v) {
    for (auto& x : v) std::cout << +x << ' ';
    std::cout << '\n';
}

static std::vector<bf16> to_bf16_host(const std::vector<float>& v) {
    std::vector<bf16> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
    return out;
}

static std::vector<float> to_f32_host(const std::vector<bf16>& v) {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_f32(v[i]);
    return out;
}

int main(int argc, char** argv) {
    std::cout.precision(9);
    std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "gate") {
        int experts, k, scoring, n_group, topk_group, renormalize, has_bias, tokens;
        float scale;
        std::cin >> experts >> k >> scoring >> n_group >> topk_group >> renormalize >> scale >>
            has_bias >> tokens;
        auto logits = read<float>((size_t)tokens * experts);
        auto bias = has_bias ? read<float>(experts) : std::vector<float>();
        std::vector<int> ids((size_t)tokens * k);
        std::vector<float> weights((size_t)tokens * k);
        launch(tokens, 256, 2 * experts * sizeof(float), [&] {
            gate_topk(logits.data(), experts, k, scoring, has_bias ? bias.data() : nullptr,
                      n_group, topk_group, renormalize, scale, ids.data(), weights.data());
        });
        print(ids);
        print(weights);
    } else if (mode == "permute") {
        // The routing of `tokens` rows to `experts`, an identity "expert", and the combine.
        int experts, tokens, k, width;
        std::cin >> experts >> tokens >> k >> width;
        int pairs = tokens * k;
        auto ids = read<int>(pairs);
        auto weights = read<float>(pairs);
        auto x = to_bf16_host(read<float>((size_t)tokens * width));
        std::vector<int> counts(experts, 0), offsets(experts + 1), cursor(experts);
        std::vector<int> slot_of_pair(pairs), source_row(pairs);
        std::vector<bf16> grouped((size_t)pairs * width);
        std::vector<float> out((size_t)tokens * width);
        launch(2, 64, 0, [&] { count_experts(ids.data(), pairs, counts.data()); });
        launch(1, 32, 0, [&] {
            expert_offsets(counts.data(), experts, offsets.data(), cursor.data());
        });
        launch(2, 64, 0, [&] {
            scatter_pairs(ids.data(), pairs, k, cursor.data(), slot_of_pair.data(),
                          source_row.data());
        });
        launch(3, 64, 0, [&] {
            gather_rows(x.data(), source_row.data(), pairs, width, grouped.data());
        });
        launch(3, 64, 0, [&] {
            combine_rows(grouped.data(), slot_of_pair.data(), weights.data(), tokens, k, width,
                         out.data());
        });
        print(offsets);
        print(out);
    } else if (mode == "swiglu") {
        int rows, inter, act;
        float alpha, limit;
        std::cin >> rows >> inter >> act >> alpha >> limit;
        auto gate_up = to_bf16_host(read<float>((size_t)rows * 2 * inter));
        std::vector<bf16> out((size_t)rows * inter);
        launch(2, 64, 0, [&] {
            swiglu(gate_up.data(), rows, inter, act, alpha, limit, out.data());
        });
        print(out);
    } else if (mode == "to_bf16") {
        size_t n;
        std::cin >> n;
        std::vector<unsigned> bits(n);
        for (auto& b : bits) std::cin >> b;
        std::vector<float> in(n);
        for (size_t i = 0; i < n; ++i) in[i] = __uint_as_float(bits[i]);
        std::vector<bf16> out(n);
        launch(2, 64, 0, [&] { to_bf16(in.data(), n, out.data()); });
        print(out);
        // And back: bf16 to f32 is exact, printed as bits.
        std::vector<float> back(n);
        launch(2, 64, 0, [&] { to_f32(out.data(), n, back.data()); });
        std::vector<unsigned> back_bits(n);
        for (size_t i = 0; i < n; ++i) back_bits[i] = __float_as_uint(back[i]);
        print(back_bits);
    } else if (mode == "fill_dummy") {
        // n values from `stream` (a u64) and `half_width` (f32 bits); prints the bf16 bits.
        size_t n;
        unsigned long long stream;
        unsigned half_width_bits;
        std::cin >> n >> stream >> half_width_bits;
        std::vector<bf16> out(n);
        launch(3, 64, 0, [&] { fill_dummy(out.data(), n, stream, __uint_as_float(half_width_bits)); });
        print(out);
    } else if (mode == "gemv") {
        // groups, m, k; then per group: its rows n, A [m, k], B [n, k].
        int groups, m, k;
        std::cin >> groups >> m >> k;
        std::vector<std::vector<bf16>> as(groups), bs(groups), cs(groups);
        std::vector<const bf16*> a_ptrs(groups), b_ptrs(groups);
        std::vector<bf16*> c_ptrs(groups);
        std::vector<int> rows(groups);
        for (int g = 0; g < groups; ++g) {
            std::cin >> rows[g];
            as[g] = to_bf16_host(read<float>((size_t)m * k));
            bs[g] = to_bf16_host(read<float>((size_t)rows[g] * k));
            cs[g].assign((size_t)rows[g] * m, 0);
            a_ptrs[g] = as[g].data();
            b_ptrs[g] = bs[g].data();
            c_ptrs[g] = cs[g].data();
        }
        unsigned warps = 4;
        launch((m + warps - 1) / warps, warps * 32, 0, [&] {
            grouped_gemv(a_ptrs.data(), b_ptrs.data(), c_ptrs.data(), rows.data(), m, k);
        }, groups);
        for (auto& c : cs) print(c);
    } else if (mode == "gemv_slot" || mode == "widen_slot") {
        // One of a slot's matrices read in its stored form (src/compute/cuda/storage.rs):
        // form (0 bf16, 1 FP8, 2 INT4) and its scale offset and integers (three; unused ones
        // 0), the matrix's offset in the slot, groups, m, k, slot bytes; then per group its
        // slot's bytes and (gemv_slot) its rows n and B [n, k]. gemv_slot prints each group's
        // C [n, m], widen_slot each group's matrix in bf16 (written with a stride of m·k + 8).
        int form, p1, p2, p3, groups, m, k;
        long long scale_offset;
        size_t matrix_at, slot_bytes;
        std::cin >> form >> scale_offset >> p1 >> p2 >> p3 >> matrix_at >> groups >> m >> k >>
            slot_bytes;
        std::vector<std::vector<unsigned char>> slots(groups);
        std::vector<std::vector<bf16>> bs(groups), cs(groups);
        std::vector<const unsigned char*> a_ptrs(groups);
        std::vector<const bf16*> b_ptrs(groups);
        std::vector<bf16*> c_ptrs(groups);
        std::vector<int> rows(groups);
        for (int g = 0; g < groups; ++g) {
            std::vector<int> bytes = read<int>(slot_bytes);
            slots[g].assign(bytes.begin(), bytes.end());
            a_ptrs[g] = slots[g].data() + matrix_at;
            if (mode == "gemv_slot") {
                std::cin >> rows[g];
                bs[g] = to_bf16_host(read<float>((size_t)rows[g] * k));
                cs[g].assign((size_t)rows[g] * m, 0);
                b_ptrs[g] = bs[g].data();
                c_ptrs[g] = cs[g].data();
            }
        }
        if (mode == "gemv_slot") {
            unsigned warps = 4;
            launch((m + warps - 1) / warps, warps * 32, 0, [&] {
                if (form == 0) {
                    grouped_gemv((const bf16* const*)a_ptrs.data(), b_ptrs.data(), c_ptrs.data(),
                                 rows.data(), m, k);
                } else if (form == 1) {
                    grouped_gemv_fp8(a_ptrs.data(), scale_offset, p1, p2, p3, b_ptrs.data(),
                                     c_ptrs.data(), rows.data(), m, k);
                } else {
                    grouped_gemv_int4(a_ptrs.data(), scale_offset, p1, p2, b_ptrs.data(),
                                      c_ptrs.data(), rows.data(), m, k);
                }
            }, groups);
            for (auto& c : cs) print(c);
        } else {
            size_t stride = (size_t)m * k + 8;
            std::vector<bf16> out(stride * groups, 0);
            launch(3, 64, 0, [&] {
                if (form == 1) {
                    widen_fp8(a_ptrs.data(), scale_offset, p1, p2, p3, out.data(), stride, m, k);
                } else {
                    widen_int4(a_ptrs.data(), scale_offset, p1, p2, out.data(), stride, m, k);
                }
            }, groups);
            for (int g = 0; g < groups; ++g) {
                print(std::vector<bf16>(out.begin() + g * stride, out.begin() + g * stride + (size_t)m * k));
            }
        }
    } else if (mode == "rms_norm") {
        // Rows `stride` apart, the first `width` of each normalised; the rest kept.
        int rows, width, stride;
        float eps;
        std::cin >> rows >> width >> stride >> eps;
        auto x = read<float>((size_t)rows * stride);
        auto w = read<float>(width);
        std::vector<float> out(x);
        launch(rows, 64, 0, [&] { rms_norm(x.data(), stride, w.data(), width, eps, out.data()); });
        print(out);
    } else if (mode == "store_rows") {
        // A paged cache: its pool of blocks of 16 positions (bf16) and the sequences' block
        // tables, then rows (sequence, position) of `width` values appended; prints the pool
        // widened to f32.
        int width, blocks, seqs, table_stride, rows;
        std::cin >> width >> blocks >> seqs >> table_stride;
        auto pool = to_bf16_host(read<float>((size_t)blocks * 16 * width));
        auto table = read<int>((size_t)seqs * table_stride);
        std::cin >> rows;
        auto row_seq = read<int>(rows);
        auto row_pos = read<int>(rows);
        auto src = read<float>((size_t)rows * width);
        launch(rows, 32, 0, [&] {
            store_rows(src.data(), width, pool.data(), table.data(), table_stride,
                       row_seq.data(), row_pos.data());
        });
        print(to_f32_host(pool));
    } else if (mode == "copy_rows") {
        int rows, src_stride, dst_stride, width;
        std::cin >> rows >> src_stride >> dst_stride >> width;
        auto src = read<float>((size_t)rows * src_stride);
        auto dst = read<float>((size_t)rows * dst_stride);
        launch(rows, 32, 0, [&] {
            copy_rows(src.data(), src_stride, dst.data(), dst_stride, width);
        });
        print(dst);
    } else if (mode == "add") {
        // x += y, then x += bias per row of `width`.
        int n, width;
        std::cin >> n >> width;
        auto x = read<float>(n);
        auto y = read<float>(n);
        auto bias = read<float>(width);
        launch(2, 32, 0, [&] { add_rows(x.data(), y.data(), n); });
        launch(2, 32, 0, [&] { add_bias(x.data(), bias.data(), width, n); });
        print(x);
    } else if (mode == "rope") {
        int rows, heads, head_width, offset, rope_dim, interleaved;
        std::cin >> rows >> heads >> head_width >> offset >> rope_dim >> interleaved;
        auto x = read<float>((size_t)rows * heads * head_width);
        auto cos = read<float>((size_t)rows * rope_dim / 2);
        auto sin = read<float>((size_t)rows * rope_dim / 2);
        launch(rows * heads, 32, rope_dim * sizeof(float), [&] {
            rope(x.data(), heads, head_width, offset, rope_dim, cos.data(), sin.data(),
                 interleaved);
        });
        print(x);
    } else if (mode == "attend" || mode == "attend_tiles" || mode == "attend_heads") {
        // A paged cache (key pool, value pool unless values are the keys, block tables),
        // then rows (sequence, position) with their queries.
        int heads, group, dk, dv, kv_stride, k_head_stride, v_head_stride, window, chunk, seqs,
            rows, values_are_keys, blocks, table_stride;
        float scale;
        std::cin >> heads >> group >> dk >> dv >> kv_stride >> k_head_stride >> v_head_stride >>
            window >> chunk >> scale >> values_are_keys >> seqs >> blocks >> table_stride;
        auto keys = to_bf16_host(read<float>((size_t)blocks * 16 * kv_stride));
        auto values =
            values_are_keys ? keys : to_bf16_host(read<float>((size_t)blocks * 16 * kv_stride));
        auto table = read<int>((size_t)seqs * table_stride);
        std::cin >> rows;
        auto row_seq = read<int>(rows);
        auto row_pos = read<int>(rows);
        auto q = read<float>((size_t)rows * heads * dk);
        std::vector<float> out((size_t)rows * heads * dv);
        if (mode == "attend_heads") {
            // Every head reads the same keys, the values their first dv values (MLA).
            int heads_per_block;
            std::cin >> heads_per_block;
            int groups = (heads + heads_per_block - 1) / heads_per_block;
            size_t shared = (size_t)heads_per_block * (dk + dv + 16 + 3) * sizeof(float) +
                            (size_t)16 * dk * sizeof(bf16);
            launch(rows * groups, 64, shared, [&] {
                attend_heads(q.data(), heads, dk, dv, keys.data(), table.data(), table_stride,
                             kv_stride, row_seq.data(), row_pos.data(), scale, heads_per_block,
                             out.data());
            });
        } else if (mode == "attend") {
            launch(rows * heads, 64, (dk + 256 + dv) * sizeof(float), [&] {
                attend(q.data(), heads, group, dk, dv, keys.data(), values.data(), table.data(),
                       table_stride, kv_stride, k_head_stride, v_head_stride, row_seq.data(),
                       row_pos.data(), window, chunk, scale, nullptr, out.data());
            });
        } else {
            // Tiles of up to `tile_rows` consecutive rows of one sequence, as the engine
            // makes them.
            int tile_rows;
            std::cin >> tile_rows;
            std::vector<int> first, len;
            for (int r = 0; r < rows; ++r) {
                bool joins = !first.empty() && len.back() < tile_rows &&
                             row_seq[r] == row_seq[r - 1] && row_pos[r] == row_pos[r - 1] + 1;
                if (joins) {
                    ++len.back();
                } else {
                    first.push_back(r);
                    len.push_back(1);
                }
            }
            int keys_per_pass = 16;
            size_t shared = (size_t)(tile_rows * (dk + dv + keys_per_pass + 3) +
                                     keys_per_pass * (dk + dv)) * sizeof(float);
            launch((int)first.size() * heads, 64, shared, [&] {
                attend_tiles(q.data(), heads, group, dk, dv, keys.data(), values.data(),
                             table.data(), table_stride, kv_stride, k_head_stride,
                             v_head_stride, row_seq.data(), row_pos.data(), window, chunk,
                             scale, nullptr, first.data(), len.data(), tile_rows, out.data());
            });
        }
        print(out);
    } else {
        std::fprintf(stderr, "usage: harness gate|permute|swiglu|to_bf16|gemv|gemv_slot|widen_slot|rms_norm|store_rows|copy_rows|add|rope|attend|attend_tiles|attend_heads\n");
        return 2;
    }
    return 0;
}
