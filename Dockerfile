# Image for Airflow, the Spark master/worker and the clickstream jobs in the cluster profile
# (docker-compose.yml). One image everywhere, so Spark executors have the same Python, the
# clickstream package and its dependencies as the drivers.
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/clickstream
COPY requirements.lock pyproject.toml README.md ./
RUN pip install --no-cache-dir -r requirements.lock \
    # Postgres drivers for Airflow's metadata DB (sync and async); the embedded profile uses
    # SQLite and does not need them, so they are not in the lock.
    && pip install --no-cache-dir "psycopg2-binary==2.9.10" "asyncpg==0.30.0"

# Spark's native Kafka source and delta-spark come from Maven (reachable in the cluster);
# spark-defaults.conf applies to spark-submit and to in-process sessions alike. Executors
# compile the large methods Spark generates, as the product's drivers do
# (spark_session.COMPILE_HUGE_METHODS): the stream parser's projection ran interpreted.
ENV SPARK_CONF_DIR=/opt/spark-conf
RUN mkdir -p "$SPARK_CONF_DIR" && printf '%s\n' \
    "spark.jars.packages org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0,io.delta:delta-spark_2.13:4.4.1" \
    "spark.jars.ivy /opt/ivy" \
    "spark.executor.extraJavaOptions -XX:-DontCompileHugeMethods" > "$SPARK_CONF_DIR/spark-defaults.conf"

COPY spark ./spark
COPY dags ./dags
COPY plugins ./plugins
COPY expectations ./expectations
COPY scripts ./scripts
RUN pip install --no-cache-dir --no-deps -e .

# Run as an unprivileged user; named volumes inherit these owners on first use.
RUN useradd --uid 50000 --home-dir /opt/airflow --create-home clickstream \
    && mkdir -p /data/warehouse /data/home /data/landing /opt/airflow/auth /opt/airflow/logs \
       /opt/ivy \
    && chown -R clickstream /data /opt/airflow /opt/ivy
USER clickstream
ENV AIRFLOW_HOME=/opt/airflow
