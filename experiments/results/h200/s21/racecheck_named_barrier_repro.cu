// Minimal repro: two warp groups, each looping over its own tiles with its own named barrier and cp.async stages,
// then __syncthreads, a shared write, __syncthreads, a shared read. Race-free by construction.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
__device__ __forceinline__ void nbar(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void cp16(void* s, const void* g) {
    unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(s));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(g));
}
__global__ void k(const float4* in, float* out, int n0, int n1, int imm) {
    __shared__ float4 stage[2][3][128];
    __shared__ float buf[8][16];
    const int tid = threadIdx.x, warp = tid / 32, wg = warp / 4, gt = tid % 128;
    const int n = wg ? n1 : n0;
    float acc = 0.f;
    for (int s = 0; s < 2; ++s) { if (s < n) cp16(&stage[wg][s][gt], in + (s * 2 + wg) * 128 + gt); asm volatile("cp.async.commit_group;\n"); }
    for (int i = 0; i < n; ++i) {
        asm volatile("cp.async.wait_group 1;\n");
        if (imm) { if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory"); else asm volatile("bar.sync 2, 128;\n" ::: "memory"); }
        else nbar(1 + wg);
        if (i + 2 < n) cp16(&stage[wg][(i + 2) % 3][gt], in + ((i + 2) * 2 + wg) * 128 + gt);
        asm volatile("cp.async.commit_group;\n");
        const float4 v = stage[wg][i % 3][(gt + 7) % 128];
        acc += v.x + v.y;
    }
    asm volatile("cp.async.wait_group 0;\n");
    __syncthreads();
    if (tid % 32 < 16) buf[warp][tid % 16] = acc;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < 8; ++w) s += buf[w][tid % 16];
    out[blockIdx.x * 256 + tid] = s;
}
int main(int argc, char** argv) {
    const int which = argc > 1 ? atoi(argv[1]) : -1;
    float4* in; float* out;
    cudaMalloc(&in, 64 * 128 * sizeof(float4)); cudaMemset(in, 0, 64 * 128 * sizeof(float4));
    cudaMalloc(&out, 132 * 256 * sizeof(float));
    int cases[][2] = {{8, 8}, {8, 7}, {1, 0}, {3, 2}, {16, 16}};
    for (int imm = 0; imm < 2; ++imm)
        for (int ci = 0; ci < 5; ++ci) if (which < 0 || which == ci) k<<<132, 256>>>(in, out, cases[ci][0], cases[ci][1], imm);
    printf("done: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
}
