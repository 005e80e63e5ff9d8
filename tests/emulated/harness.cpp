// Runs one kernel of kernels/moe.cu on the CPU (through cuda_on_cpu.h) on numbers read from
// standard input, and prints what it wrote. Driven by tests/kernels_on_cpu.rs, which builds
// this with the kernel sources as "kernels.inc".

#include "cuda_on_cpu.h"
#include "kernels.inc"

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
        int rows, inter;
        std::cin >> rows >> inter;
        auto gate_up = to_bf16_host(read<float>((size_t)rows * 2 * inter));
        std::vector<bf16> out((size_t)rows * inter);
        launch(2, 64, 0, [&] { swiglu(gate_up.data(), rows, inter, out.data()); });
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
    } else {
        std::fprintf(stderr, "usage: harness gate|permute|swiglu|to_bf16 < numbers\n");
        return 2;
    }
    return 0;
}
