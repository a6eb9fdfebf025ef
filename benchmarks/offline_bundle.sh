#!/usr/bin/env bash
# Packs what a GPU machine without a network needs to run the GPU tests and bench_gpu.py
# when its image has PyTorch but no Java and no PySpark (how session 11 ran them on an H100):
#
#   a Java 17 runtime cut down by jlink (84 MB; Spark's modules, incubator.vector included),
#   PySpark's Python package and py4j, with the jars of a local session and local-cluster
#   only (no Hive, Kubernetes, YARN, Connect server, RocksDB, ORC, MLlib), and
#   the wheels the image lacks (cryptography, cffi, pycparser, cloudpickle, pandas < 3).
#
#   benchmarks/offline_bundle.sh OUT_DIR [PART_MB]
#
# writes OUT_DIR/stack.tar.xz (about 210 MB) split into OUT_DIR/stack.partNN of PART_MB
# (default 57) for transfers with a size limit, and OUT_DIR/whl/. On the GPU machine:
#
#   cat stack.part* | xz -d | tar -C /tmp -xf -
#   SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
#   cp -r /tmp/sp/pyspark /tmp/sp/py4j "$SITE"/ && echo "$PWD" > "$SITE"/sparkdl_repo.pth
#   python3 -m pip install --no-index --no-deps whl/*.whl
#   export JAVA_HOME=/tmp/jre PATH=/tmp/jre/bin:$PATH SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON=$(which python3)
#   python3 -m pytest -m gpu tests && python3 benchmarks/bench_gpu.py
set -euo pipefail
out=${1:?usage: offline_bundle.sh OUT_DIR [PART_MB]}
part_mb=${2:-57}
python=${PYTHON:-.venv/bin/python}
site=$("$python" -c 'import pyspark, pathlib; print(pathlib.Path(pyspark.__file__).parent.parent)')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

jlink --add-modules java.base,java.compiler,java.datatransfer,java.desktop,java.instrument,java.logging,\
java.management,java.management.rmi,java.naming,java.net.http,java.prefs,java.rmi,java.scripting,\
java.security.jgss,java.security.sasl,java.sql,java.sql.rowset,java.transaction.xa,java.xml,java.xml.crypto,\
jdk.unsupported,jdk.unsupported.desktop,jdk.crypto.ec,jdk.crypto.cryptoki,jdk.management,jdk.management.agent,\
jdk.naming.dns,jdk.zipfs,jdk.httpserver,jdk.security.auth,jdk.security.jgss,jdk.jdwp.agent,jdk.attach,jdk.jfr,\
jdk.charsets,jdk.net,jdk.sctp,jdk.incubator.vector,jdk.incubator.foreign \
    --strip-debug --no-header-files --no-man-pages --compress=0 --output "$work/jre"

mkdir -p "$work/sp"
tar -C "$site" --exclude='__pycache__' --exclude='pyspark/tests' --exclude='pyspark/*/tests' \
    --exclude='pyspark/*/*/tests' --exclude='pyspark/examples' --exclude='pyspark/jars' -cf - pyspark py4j |
    tar -C "$work/sp" -xf -
mkdir "$work/sp/pyspark/jars"
for jar in "$site"/pyspark/jars/*.jar; do
    case $(basename "$jar") in
    rocksdbjni* | hive-* | kubernetes-* | spark-kubernetes* | spark-yarn* | spark-hive* | spark-connect* | \
        connect-repl* | derby* | datanucleus-* | breeze* | spire* | cats-kernel* | algebra_* | scala-compiler* | \
        orc-* | lapack* | arpack* | blas* | jpam* | libthrift* | libfb303* | curator-* | zookeeper* | vertx-* | \
        volcano-* | zjsonpatch* | spark-repl* | jline* | spark-graphx* | spark-pipelines* | spark-mllib_* | \
        netty-tcnative-boringssl-static* | netty-transport-native-kqueue* | netty-transport-classes-kqueue* | \
        JTransforms* | JLargeArrays* | jts-core* | javolution* | jdo-api* | javax.jdo* | HikariCP* | \
        commons-dbcp* | ST4* | antlr-runtime* | opencsv* | super-csv* | transaction-api* | jta* | stax-api* | \
        snakeyaml* | jackson-dataformat-yaml* | jjwt-* | java-diff-utils*) ;;
    *) cp "$jar" "$work/sp/pyspark/jars/" ;;
    esac
done

tar -C "$work" -cf - sp jre | xz -T0 -6 >"$out/stack.tar.xz"
split -b "${part_mb}M" -d "$out/stack.tar.xz" "$out/stack.part"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "${TARGET_PYTHON:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out/whl" \
    cryptography cffi pycparser cloudpickle 'pandas<3' pytz tzdata
ls -la "$out"
