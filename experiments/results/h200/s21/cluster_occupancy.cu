// How many clusters of each size fit at once with one 8-warp, ~100 KB block an SM (the two-group decode block).
#include <cstdio>
#include <cuda_runtime.h>
__global__ void __cluster_dims__(1, 1, 1) dummy1(float* p) { if (p) p[threadIdx.x] = 0.f; }
__global__ void dummy(float* p) { extern __shared__ float s[]; if (p) p[threadIdx.x] = s[threadIdx.x]; }
int main() {
    cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
    printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    cudaFuncSetAttribute(dummy, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    for (int smem : {102656, 120 * 1024}) {
        cudaFuncSetAttribute(dummy, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        for (int threads : {256}) for (int cs : {1, 2, 4, 8, 16}) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(cs * 8, 1, 1); cfg.blockDim = dim3(threads); cfg.dynamicSmemBytes = smem;
            cudaLaunchAttribute attr; attr.id = cudaLaunchAttributeClusterDimension;
            attr.val.clusterDim.x = cs; attr.val.clusterDim.y = 1; attr.val.clusterDim.z = 1;
            cfg.attrs = &attr; cfg.numAttrs = 1;
            int n = -1; cudaError_t e = cudaOccupancyMaxActiveClusters(&n, dummy, &cfg);
            printf("smem %6d threads %3d cluster %2d: max active clusters %3d (%d blocks) %s\n", smem, threads, cs, n,
                   n * cs, e == cudaSuccess ? "" : cudaGetErrorString(e));
        }
    }
}
