# Image for Airflow and the clickstream jobs in the cluster profile (docker-compose.yml).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/clickstream
COPY requirements.lock pyproject.toml README.md ./
RUN pip install --no-cache-dir -r requirements.lock
COPY spark ./spark
COPY dags ./dags
COPY plugins ./plugins
COPY expectations ./expectations
RUN pip install --no-cache-dir --no-deps -e .
