# Sourced by gpu_run.sh and gpu_tuned.sh (with G, OUT and PY set): the environment of a device run over the carried
# .gpu/ folder, and the carried wheels (.gpu/whl) installed into /tmp/site where optuna is not importable.
mkdir -p "$OUT"
export FEDMTL_CACHE=$G/cache FEDMTL_VERIFY_MD5=0 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MPLBACKEND=Agg
export PYTHONPATH=$G/tree/src:$G/tree:$G/site
if [ -d "$G/whl" ] && ! $PY -c "import optuna" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site || echo "the wheels of .gpu/whl did not install"
fi
