cd /work/main
unset PYTHONDONTWRITEBYTECODE
t0=$(date +%s)
nice -n 19 .venv/bin/python -m pytest -m "not multiprocess" -n 4 --durations=12 > /tmp/ov1/single.txt 2>&1 &
sp=$!
.venv/bin/python -m pytest -m "multiprocess and serial" --durations=12 > /tmp/ov1/serial.txt 2>&1; serial=$?; t1=$(date +%s)
wait $sp; single=$?; t2=$(date +%s)
echo "serial exit $serial in $((t1-t0)) s; single exit $single in $((t2-t0)) s" > /tmp/ov1/result.txt
