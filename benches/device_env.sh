# Sourced by the GPU benchmarks after they set OUTDIR: the kernel cache under $OUTDIR (unless
# FUSEC_CACHE_DIR is set), CUDA's libraries (libnvrtc, libcublas) where the toolkit keeps them
# if the loader does not know them, and a line naming the GPUs.
export FUSEC_CACHE_DIR=${FUSEC_CACHE_DIR:-$OUTDIR/cache}
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
